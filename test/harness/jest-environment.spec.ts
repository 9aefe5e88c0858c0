// The suite fails a test on what Node would only print: run in a Jest of its own, with the suite's
// configuration (its test environment, test/support/jest-environment.mjs), each test of
// test/fixtures/jest-guard.fixture.ts passes or fails as the suite must decide.
import { afterAll, describe, expect, it } from '@jest/globals';
import { execFile } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { promisify } from 'node:util';
import { processRunning } from '../support/children.js';
import { repoRoot } from '../support/paths.js';
import { until } from '../support/redis-server.js';

interface JestReport {
  testResults: { message: string; assertionResults: { title: string; status: string; failureMessages: string[] }[] }[];
}

/** Where the fixture's test 'left running' writes the pids of the processes it leaves running. */
const pidsDir = mkdtempSync(join(tmpdir(), 'nestjs-locked-guard-'));
const pidsFile = join(pidsDir, 'pids');
afterAll(() => rmSync(pidsDir, { recursive: true, force: true }));

/** Each fixture test's status and failure messages, and under '(file)' the file's own message. */
async function runFixture(): Promise<Map<string, { status: string; message: string }>> {
  const jest = join(repoRoot, 'node_modules', 'jest', 'bin', 'jest.js');
  const { default: config } = (await import(pathToFileURL(join(repoRoot, 'jest.config.mjs')).href)) as { default: Record<string, unknown> };
  // The suite's own configuration, on the fixture alone; no global setup (it rebuilds .test-build,
  // which the suite's child processes read meanwhile).
  const own = { ...config, rootDir: repoRoot, roots: ['<rootDir>/test/fixtures'], testMatch: ['**/jest-guard.fixture.ts'], globalSetup: undefined, testPathIgnorePatterns: [] };
  const run = await promisify(execFile)(
    process.execPath,
    ['--experimental-vm-modules', '--disable-warning=ExperimentalWarning', jest, '--config', JSON.stringify(own), '--json', '--runInBand'],
    { cwd: repoRoot, timeout: 50_000, maxBuffer: 16 * 1024 * 1024, env: { ...process.env, GUARD_PIDS_FILE: pidsFile } },
  ).catch((error: { stdout?: string }) => ({ stdout: error.stdout ?? '' })); // Jest exits 1: some tests fail, as they must
  const report = JSON.parse(run.stdout) as JestReport;
  return new Map(
    report.testResults.flatMap((file) => [
      ['(file)', { status: '', message: file.message }],
      ...file.assertionResults.map((a) => [a.title, { status: a.status, message: a.failureMessages.join('\n') }] as const),
    ]),
  );
}

describe('the suite fails a test on', () => {
  let results: Map<string, { status: string; message: string }>;
  const result = async (title: string) => {
    results ??= await runFixture();
    return results.get(title);
  };

  it('a DeprecationWarning, naming it', async () => {
    const r = await result('deprecation');
    expect(r?.status).toBe('failed');
    expect(r?.message).toContain('DeprecationWarning (DEP9999): guard fixture: this API is deprecated');
  });

  it('a MaxListenersExceededWarning', async () => {
    const r = await result('listener leak');
    expect(r?.status).toBe('failed');
    expect(r?.message).toContain('MaxListenersExceededWarning');
  });

  it('a DeprecationWarning that a fixture process printed, naming the fixture', async () => {
    const r = await result('fixture process deprecation');
    expect(r?.status).toBe('failed');
    expect(r?.message).toMatch(/fixture warning-child \(pid \d+\) printed: .*DeprecationWarning: guard fixture child: this API is deprecated/);
  });

  it('an unhandled rejection and an uncaught exception', async () => {
    expect((await result('unhandled rejection'))?.message).toContain('guard fixture: nobody catches this');
    expect((await result('uncaught exception'))?.message).toContain('guard fixture: nobody catches this either');
  });

  it('a failing warning or an unhandled rejection after the last test: the file fails', async () => {
    expect((await result('(file)'))?.message).toContain('DeprecationWarning (DEP9998): guard fixture: deprecated after the last test');
    expect((await result('(file)'))?.message).toContain('guard fixture: rejected after the last test');
  });

  it('a fixture, a redis-server or a process group still running after the last test: the file fails, and they are killed', async () => {
    const message = (await result('(file)'))?.message ?? '';
    const [fixture, server, group, sleep] = readFileSync(pidsFile, 'utf8').split(' ').map(Number) as [number, number, number, number];
    try {
      expect(message).toContain(`fixture warning-child (pid ${fixture}) was still running after the file's last test and afterAll hooks: stop it there`);
      expect(message).toMatch(new RegExp(`redis-server on port \\d+ \\(pid ${server}\\) was still running after the file's last test and afterAll hooks: stop it there`));
      // Its leader had exited; the group's other process had not.
      expect(message).toContain(`command sh (process group ${group}) was still running after the file's last test and afterAll hooks: stop it there`);
      // A group still exiting at the file's end (here, a sleep of 1 s) is waited for, up to 2 s.
      expect(message).not.toContain('command sh -c sleep 1');
      // Killed when the file failed for them; gone once their parent, the Jest run, ended.
      for (const pid of [fixture, server, sleep]) await until(async () => !processRunning(pid), 5_000, `process ${pid} gone`);
    } finally {
      for (const pid of [fixture, server, sleep]) if (processRunning(pid)) process.kill(pid, 'SIGKILL');
    }
  });

  it('nothing else: not on another warning, nor on a clean test, nor on the test that left them running', async () => {
    expect((await result('left running'))?.status).toBe('passed');
    expect((await result('other warning'))?.status).toBe('passed');
    expect((await result('clean'))?.status).toBe('passed');
  });
});
