// `npm run bench:instructions`: what one acquire + release pair costs redis-server in CPU
// instructions, counted by valgrind's callgrind (the same count for the same binary and inputs,
// whatever else the machine is doing, unlike times on this shared 2-core machine). For the raw
// limit (SET NX PX + compare-and-delete), for nestjs-locked's scripts as they are, and for the
// scripts of earlier commits (INSTRUCTIONS_BEFORE=<commit>[,<commit>...], read with git show), each on its own
// redis-server under callgrind: warm up, zero the counters, run the pairs, dump, divide.
// INSTRUCTIONS_BREAKDOWN=1 adds variants of our scripts with one part taken out (no body at all, no
// fencing token, no release announcement), to show what each part costs.
import { execFileSync, spawn } from 'node:child_process';
import { mkdtempSync, readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Redis } from 'ioredis';
import { ACQUIRE, RELEASE } from '../lib/store/redis/lock.scripts.js';
import { SCRIPT_VARIANTS, scriptsPair } from './our-scripts.js';
import { repoRoot } from '../test/support/paths.js';

const PAIRS = Number(process.env.INSTRUCTIONS_PAIRS ?? 2_000);
const CAD = `if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end`;

type Pair = (client: Redis, i: number) => Promise<void>;

function ourPair(acquire: string, release: string, grantCounterTtlMs?: number): (client: Redis) => Promise<Pair> {
  return async (client) => {
    const pair = await scriptsPair(client, acquire, release, grantCounterTtlMs);
    return (_c, i) => pair(`k${i}`, `instance-id-xyz:${i}`);
  };
}

const kinds: Record<string, (client: Redis) => Promise<Pair>> = {
  raw: async (client) => {
    const sha = (await client.script('LOAD', CAD)) as string;
    return async (c, i) => {
      const id = `0123456789abcdef0123456789abcdef:${i}`;
      await c.set(`k${i}`, id, 'PX', 30_000, 'NX');
      await c.evalsha(sha, 1, `k${i}`, id);
    };
  },
  'nestjs-locked scripts': ourPair(ACQUIRE, RELEASE),
  'nestjs-locked scripts, fencingTokens: false': ourPair(ACQUIRE, RELEASE, 0),
};

if (process.env.INSTRUCTIONS_BREAKDOWN) {
  for (const variant of Object.values(SCRIPT_VARIANTS)) kinds[variant.label] = ourPair(variant.acquire, variant.release);
}

// INSTRUCTIONS_BEFORE=<commit>[,<commit>...]: the scripts of earlier commits, each its own row.
for (const before of (process.env.INSTRUCTIONS_BEFORE ?? '').split(',').filter(Boolean)) {
  // The scripts module of that commit, compiled on the fly: its ACQUIRE and RELEASE strings only.
  const source = execFileSync('git', ['show', `${before}:lib/store/redis/lock.scripts.ts`], { cwd: repoRoot, encoding: 'utf8' });
  const dir = mkdtempSync(join(tmpdir(), 'scripts-before-'));
  const { transformSync } = await import('@swc/core');
  writeFileSync(join(dir, 'scripts.mjs'), transformSync(source, { jsc: { parser: { syntax: 'typescript' }, target: 'es2022' }, module: { type: 'es6' } }).code);
  const old = (await import(join(dir, 'scripts.mjs'))) as { ACQUIRE: string; RELEASE: string };
  kinds[`nestjs-locked scripts at ${before.slice(0, 7)}`] = ourPair(old.ACQUIRE, old.RELEASE);
}

async function freePort(): Promise<number> {
  return new Promise((resolve) => {
    const server = createServer().listen(0, '127.0.0.1', () => {
      const { port } = server.address() as { port: number };
      server.close(() => resolve(port));
    });
  });
}

async function instructionsPerPair(make: (client: Redis) => Promise<Pair>): Promise<number> {
  const port = await freePort();
  const dir = mkdtempSync(join(tmpdir(), 'callgrind-'));
  const child = spawn('valgrind', ['--tool=callgrind', `--callgrind-out-file=${dir}/out.%p`, 'redis-server', '--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no'], { stdio: 'ignore' });
  const client = new Redis(port, '127.0.0.1', { retryStrategy: () => 100, maxRetriesPerRequest: null });
  client.on('error', () => undefined);
  try {
    await client.ping();
    const pair = await make(client);
    for (let i = 0; i < 200; i++) await pair(client, -1 - i); // warm-up
    execFileSync('callgrind_control', ['--zero', String(child.pid)], { stdio: 'ignore' });
    for (let i = 0; i < PAIRS; i++) await pair(client, i);
    execFileSync('callgrind_control', ['--dump=measured', String(child.pid)], { stdio: 'ignore' });
    const dump = readdirSync(dir).find((f) => /\.\d+$/.test(f) && f !== `out.${child.pid}`) ?? readdirSync(dir)[0]!;
    const totals = /^(?:summary|totals): (\d+)/m.exec(readFileSync(join(dir, dump), 'utf8'));
    return Number(totals?.[1]) / PAIRS;
  } finally {
    client.disconnect();
    child.kill('SIGKILL');
  }
}

for (const tool of ['valgrind', 'callgrind_control']) {
  try {
    execFileSync(tool, ['--version'], { stdio: 'ignore' });
  } catch {
    console.error(`${tool} not found: npm run bench:instructions needs valgrind (Debian/Ubuntu: sudo apt-get install -y valgrind)`);
    process.exit(1);
  }
}

const out: Record<string, number> = {};
for (const [name, make] of Object.entries(kinds)) {
  out[name] = Math.round(await instructionsPerPair(make));
  console.log(`${name.padEnd(40)} ${out[name]!.toLocaleString('en-US').padStart(10)} redis-server instructions per pair (${(out[name]! / out.raw!).toFixed(2)}x raw)`);
}
if (process.env.INSTRUCTIONS_OUT) writeFileSync(process.env.INSTRUCTIONS_OUT, JSON.stringify({ pairs: PAIRS, instructionsPerPair: out }, null, 2) + '\n');
