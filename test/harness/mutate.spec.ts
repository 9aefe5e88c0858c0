// scripts/mutate.mjs, the mutation rounds' runner (TESTING.md, "Mutation rounds"), on a small file
// and a command that reads it: which mutants it counts killed, that it puts the file back, and
// that a second round is refused while one runs.
import { afterAll, describe, expect, it } from '@jest/globals';
import { execFile, spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { processRunning, track } from '../support/children.js';
import { repoRoot } from '../support/paths.js';
import { until } from '../support/redis-server.js';

const dir = mkdtempSync(join(tmpdir(), 'nestjs-locked-mutate-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const mutateScript = join(repoRoot, 'scripts', 'mutate.mjs');
const SUBJECT = 'a = 1\nb = 2\n';

/** A subject file, its mutants file and a lock file of the test's own (the runner's lock is per machine). */
function round(name: string, mutants: [string, string, string][]) {
  const subject = join(dir, `${name}.txt`);
  const mutantsFile = join(dir, `${name}.mutants.json`);
  writeFileSync(subject, SUBJECT);
  writeFileSync(mutantsFile, JSON.stringify(mutants));
  return { subject, mutantsFile, lock: join(dir, `${name}.lock`), out: join(dir, `${name}.out.json`) };
}

/** Runs the runner to its end: its exit code and output. */
function mutate(args: string[], lock: string): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(process.execPath, [mutateScript, ...args], { env: { ...process.env, MUTATE_LOCK_FILE: lock }, timeout: 30_000 }, (error, stdout, stderr) => {
      resolve({ code: error ? Number(error.code) : 0, stdout, stderr });
    });
  });
}

/** A command that passes while `file` still says "a = 1", and ends by SIGKILL once it says "b = 0". */
const passesWhileA1 = (file: string) => [
  process.execPath,
  '-e',
  "const text = require('fs').readFileSync(process.argv[1], 'utf8'); if (text.includes('b = 0')) process.kill(process.pid, 'SIGKILL'); process.exit(text.includes('a = 1') ? 0 : 1);",
  file,
];

describe('scripts/mutate.mjs', () => {
  it('counts a mutant the command fails on (or is ended by a signal on) as killed and one it passes on as survived, skips one not found once, and puts the file back', async () => {
    const r = round('counts', [
      ['a = 1', 'a = 9', 'changes a'],
      ['b = 2', 'b = 3', 'changes b'],
      ['b = 2', 'b = 0', 'ends the command'],
      ['c = 3', 'c = 4', 'absent'],
      [' = ', ' == ', 'ambiguous'],
    ]);
    const run = await mutate([r.subject, r.mutantsFile, '--out', r.out, '--', ...passesWhileA1(r.subject)], r.lock);
    expect(run.code).toBe(0);
    expect(run.stdout.trim().split('\n')).toEqual([
      'killed      changes a',
      'survived    changes b',
      'killed      ends the command',
      'not applied absent (not found)',
      'not applied ambiguous (found 2 times)',
      '5 mutants: 2 killed, 1 survived, 2 not applied',
    ]);
    expect((JSON.parse(readFileSync(r.out, 'utf8')) as { note: string; status: string }[]).map((m) => `${m.note}: ${m.status}`)).toEqual([
      'changes a: killed',
      'changes b: survived',
      'ends the command: killed',
      'absent: not applied',
      'ambiguous: not applied',
    ]);
    expect(readFileSync(r.subject, 'utf8')).toBe(SUBJECT);
    expect(existsSync(r.lock)).toBe(false);
  });

  it('runs no mutant when the command fails on the file as it is', async () => {
    const r = round('baseline', [['a = 1', 'a = 9', 'changes a']]);
    const run = await mutate([r.subject, r.mutantsFile, '--', process.execPath, '-e', 'process.exit(1)'], r.lock);
    expect(run.code).toBe(4);
    expect(run.stderr).toMatch(/the command fails on .* as it is; a round needs a passing command/);
    expect(run.stdout).toBe('');
    expect(readFileSync(r.subject, 'utf8')).toBe(SUBJECT);
    expect(existsSync(r.lock)).toBe(false);
  });

  it.each(['SIGINT', 'SIGTERM'] as const)('refuses a second round while one runs, and puts the file back and stops the command when the first is stopped with %s mid-mutant', async (signal) => {
    const r = round(`stopped-${signal}`, [['a = 1', 'a = 9', 'changes a']]);
    const marker = join(dir, `stopped-${signal}.pid`);
    // Passes on the file as it is; on the mutant, writes its pid and waits to be stopped.
    const script =
      "const fs = require('fs'); if (fs.readFileSync(process.argv[1], 'utf8').includes('a = 1')) process.exit(0); fs.writeFileSync(process.argv[2], String(process.pid)); setInterval(() => {}, 1000);";
    const first = spawn(process.execPath, [mutateScript, r.subject, r.mutantsFile, '--', process.execPath, '-e', script, r.subject, marker], {
      env: { ...process.env, MUTATE_LOCK_FILE: r.lock },
      stdio: 'ignore',
    });
    track(first, 'the first mutation round');
    const exited = new Promise<number | null>((resolve) => first.on('exit', (code) => resolve(code)));
    await until(async () => existsSync(marker), 20_000, 'the command running on the mutant');
    expect(readFileSync(r.subject, 'utf8')).toBe('a = 9\nb = 2\n');

    const second = await mutate([r.subject, r.mutantsFile, '--', ...passesWhileA1(r.subject)], r.lock);
    expect(second.code).toBe(3);
    expect(second.stderr).toContain(`another round (pid ${first.pid}) is changing ${r.subject}`);

    const commandPid = Number(readFileSync(marker, 'utf8'));
    try {
      first.kill(signal);
      expect(await exited).toBe(signal === 'SIGINT' ? 130 : 143);
      expect(readFileSync(r.subject, 'utf8')).toBe(SUBJECT);
      expect(existsSync(r.lock)).toBe(false);
      await until(async () => !processRunning(commandPid), 5_000, 'the command stopped');
    } finally {
      // A runner that failed to stop it would leave it waiting for ever.
      if (processRunning(commandPid)) process.kill(commandPid, 'SIGKILL');
    }
  });
});
