// A mutation round on one file (TESTING.md, "Mutation rounds"): each mutant replaces one piece of
// the file's text, the command runs against it, and the file is put back. A mutant the command
// fails on is killed; one it passes on survived, and needs a test or a reason it changes nothing.
//
//   node scripts/mutate.mjs <file> <mutants.json> [--out <results.json>] -- <command> [args...]
//   node scripts/mutate.mjs lib/renewal/watchdog.ts wd.json -- npm run test:jest -- test/core/watchdog.spec.ts
//
// mutants.json: [[find, replace, note], ...]; `find` must occur exactly once in the file, or the
// mutant is not applied (reported, not run). The command runs once on the file as it is first, and
// the round stops there if it fails. One round at a time per machine: a second one is refused
// while the first runs (two rounds on one file would each take the other's mutant for the
// original). The file is put back after each mutant, and on SIGINT, SIGTERM or a crash.
// Prints one line per mutant and a summary; exits 0 once the round ran, whatever survived.
import { spawn } from 'node:child_process';
import { readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';

const LOCK = process.env.MUTATE_LOCK_FILE ?? join(tmpdir(), 'nestjs-locked-mutate.lock');

function usage(message) {
  console.error(`mutate: ${message}\nusage: node scripts/mutate.mjs <file> <mutants.json> [--out <results.json>] -- <command> [args...]`);
  process.exit(2);
}

const argv = process.argv.slice(2);
const dash = argv.indexOf('--');
if (dash === -1 || dash === argv.length - 1) usage('no command after --');
const [command, ...commandArgs] = argv.slice(dash + 1);
const own = argv.slice(0, dash);
const outAt = own.indexOf('--out');
const out = outAt === -1 ? undefined : own.splice(outAt, 2)[1];
if (outAt !== -1 && !out) usage('--out needs a file name');
if (own.length !== 2) usage('expected a file and a mutants file');
const file = resolve(own[0]);
const mutants = JSON.parse(readFileSync(own[1], 'utf8'));
if (!Array.isArray(mutants) || !mutants.every((m) => Array.isArray(m) && m.length === 3 && m.every((part) => typeof part === 'string'))) {
  usage(`${own[1]} must hold an array of [find, replace, note] string triples`);
}

/** True when process `pid` exists. */
function alive(pid) {
  try {
    process.kill(pid, 0);
    return true;
  } catch (error) {
    return error.code === 'EPERM';
  }
}

try {
  writeFileSync(LOCK, JSON.stringify({ pid: process.pid, file }), { flag: 'wx' });
} catch (error) {
  if (error.code !== 'EEXIST') throw error;
  const holder = JSON.parse(readFileSync(LOCK, 'utf8'));
  if (alive(holder.pid)) {
    console.error(`mutate: another round (pid ${holder.pid}) is changing ${holder.file}; wait for it to end (or remove ${LOCK} if that pid is not a round).`);
    process.exit(3);
  }
  // A round that died without putting its lock back: take it over.
  writeFileSync(LOCK, JSON.stringify({ pid: process.pid, file }));
}

const original = readFileSync(file, 'utf8');
let mutated = false;
function restore() {
  if (mutated) writeFileSync(file, original);
  mutated = false;
}
function finish() {
  restore();
  rmSync(LOCK, { force: true });
}
/** The command's process while it runs, stopped with the round. */
let child;
for (const signal of ['SIGINT', 'SIGTERM']) {
  process.on(signal, () => {
    finish();
    child?.kill('SIGTERM');
    process.exit(128 + (signal === 'SIGINT' ? 2 : 15));
  });
}

/** Runs the command: passed when it exits 0 (a signal that ends it counts as a failure), and what it printed. */
function runCommand() {
  return new Promise((resolvePromise, reject) => {
    const chunks = [];
    child = spawn(command, commandArgs, { stdio: ['ignore', 'pipe', 'pipe'] });
    child.stdout.on('data', (d) => chunks.push(d));
    child.stderr.on('data', (d) => chunks.push(d));
    child.on('error', reject);
    child.on('close', (code) => {
      child = undefined;
      resolvePromise({ ok: code === 0, output: Buffer.concat(chunks).toString('utf8') });
    });
  });
}

/** The names of the failed tests in Jest's output, when there are any. */
const failedTests = (output) => [...new Set([...output.matchAll(/^\s*(?:✕|●) (.+?)(?: \(\d+ m?s\))?$/gm)].map((m) => m[1]))].slice(0, 5);

const results = [];
try {
  const baseline = await runCommand();
  if (!baseline.ok) {
    console.error(`mutate: the command fails on ${own[0]} as it is; a round needs a passing command.\n${baseline.output.slice(-4_000)}`);
    process.exitCode = 4;
  } else {
    for (const [find, replace, note] of mutants) {
      const count = original.split(find).length - 1;
      if (count !== 1) {
        results.push({ note, status: 'not applied', reason: count === 0 ? 'not found' : `found ${count} times` });
      } else {
        mutated = true;
        writeFileSync(file, original.replace(find, () => replace));
        const started = Date.now();
        const run = await runCommand();
        restore();
        results.push({ note, status: run.ok ? 'survived' : 'killed', failed: run.ok ? [] : failedTests(run.output), seconds: Math.round((Date.now() - started) / 1000) });
      }
      const last = results[results.length - 1];
      console.log(`${last.status.padEnd(11)} ${note}${last.reason ? ` (${last.reason})` : ''}${last.failed?.length ? `: ${last.failed[0]}` : ''}`);
      if (out) writeFileSync(out, `${JSON.stringify(results, null, 1)}\n`);
    }
    const count = (status) => results.filter((r) => r.status === status).length;
    console.log(`${results.length} mutants: ${count('killed')} killed, ${count('survived')} survived, ${count('not applied')} not applied`);
  }
} finally {
  finish();
}
