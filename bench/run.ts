// `npm run bench`: every scenario of BENCHMARKS.md against one private redis-server. Scenarios 1, 2
// and 4 run in short slices, every library (or endpoint) once per round, 4 x BENCH_REPEATS rounds
// (BENCH_REPEATS, default 3); scenario 3 runs BENCH_REPEATS rounds, every library and both PING
// readings once per round; scenario 5 is repeated BENCH_REPEATS times. Each is reported as the
// median run. Ratios are computed within this run only, so the noise of a shared machine cancels
// out. Writes bench/results/latest.json and BENCHMARKS.md. BENCH_ONLY=1,3 runs some scenarios only
// (and does not rewrite BENCHMARKS.md).
import { fork } from 'node:child_process';
import { writeFileSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { monitorEventLoopDelay, performance } from 'node:perf_hooks';
import { fileURLToPath } from 'node:url';
import { Redis } from 'ioredis';
import { LockService } from '../lib/index.js';
import { RedisServer, scriptCalls } from '../test/support/redis-server.js';
import { makeLocker, type Locker, type LockerKind } from './lockers.js';
import { jain, measuredOn, median, percentile, round, timedLoops } from './stats.js';
import { pingFigures, timedPings } from './ping.js';
import { writeReport } from './report.js';
import { startHttpApp } from './http-app-child.js';
import { repoRoot } from '../test/support/paths.js';

const here = dirname(fileURLToPath(import.meta.url));
const REPEATS = Number(process.env.BENCH_REPEATS ?? 3);
const SLICES = 4 * REPEATS;
const ONLY = (process.env.BENCH_ONLY ?? '1,2,3,4,5').split(',').map(Number);
const log = (...args: unknown[]) => console.log(`[bench ${new Date().toISOString().slice(11, 19)}]`, ...args);

type Row = Record<string, number | string | number[]>;

interface Slice {
  /** The slice's rate (pairs/s or requests/s): the figure that rounds pair up on. */
  rate: number;
  /** Per-operation latencies in ms, pooled over the slices for p50 and p99. */
  latencies?: number[];
  /** Figures kept as the median of the slices. */
  medians?: Record<string, number>;
  /** Figures summed over the slices. */
  sums?: Record<string, number>;
}

/**
 * Scenarios 1, 2 and 4: every kind runs one short slice per round, SLICES rounds, on a locker (or
 * endpoint) opened once, in a rotated order each round (so none is always first). On this machine
 * the speed of everything moves by up to 2 x within seconds (the raw limit alone, between the rounds
 * of one run); kinds compared within one round ran within a second or two of each other, so
 * report.ts compares two kinds by the median of their per-round ratios (`runs` holds each round's
 * rate, in round order). Each kind's figure is the median of its slices.
 */
async function sliced<K extends string, L>(
  kinds: K[],
  open: (kind: K) => Promise<L>,
  slice: (kind: K, opened: L) => Promise<Slice>,
  close: (opened: L) => Promise<void>,
  field: string,
): Promise<Record<K, Row>> {
  const opened = new Map<K, L>();
  for (const kind of kinds) opened.set(kind, await open(kind));
  const slices = new Map<K, Slice[]>(kinds.map((k) => [k, []]));
  try {
    for (const kind of kinds) await slice(kind, opened.get(kind)!); // warm-up, not counted
    for (let r = 0; r < SLICES; r++) {
      for (const kind of rotated(kinds, r)) slices.get(kind)!.push(await slice(kind, opened.get(kind)!));
    }
  } finally {
    for (const l of opened.values()) await close(l);
  }
  const out = {} as Record<K, Row>;
  for (const [kind, list] of slices) {
    const row: Row = { [field]: round(median(list.map((s) => s.rate)), 0) };
    const latencies = list.flatMap((s) => s.latencies ?? []);
    if (latencies.length) Object.assign(row, { p50Ms: round(percentile(latencies, 50), 3), p99Ms: round(percentile(latencies, 99), 3) });
    for (const name of Object.keys(list[0]?.medians ?? {})) row[name] = round(median(list.map((s) => s.medians![name]!)), 3);
    for (const name of Object.keys(list[0]?.sums ?? {})) row[name] = list.reduce((sum, s) => sum + s.sums![name]!, 0);
    row.runs = list.map((s) => round(s.rate, 0));
    out[kind] = row;
    log(kind, { ...row, runs: `${list.length} slices` });
  }
  return out;
}

/** `kinds` in round `r`'s order: rotated by `r`, so that none is always first. */
const rotated = <K>(kinds: K[], r: number): K[] => kinds.map((_, i) => kinds[(i + r) % kinds.length]!);

/** The run whose `by` is the median, with `runs` = every run's `by`, in the order they ran. */
function medianRun<T extends Row>(runs: T[], by: (run: T) => number): T & { runs: number[] } {
  const sorted = [...runs].sort((a, b) => by(a) - by(b));
  return { ...sorted[Math.floor(sorted.length / 2)]!, runs: runs.map(by) };
}

/** Runs `fn` REPEATS times and keeps the run whose `by` is the median. */
async function repeated<T extends Row>(fn: () => Promise<T>, by: keyof T): Promise<T & { runs: number[] }> {
  const runs: T[] = [];
  for (let i = 0; i < REPEATS; i++) runs.push(await fn());
  return medianRun(runs, (run) => Number(run[by]));
}

/**
 * Scenario 3: REPEATS rounds, each running every kind once in a rotated order (so none is always
 * first), as `sliced` does for scenarios 1, 2 and 4. Each kind's row is its median run by
 * `handoffP50Ms` (by `p50Ms` for PING rows), with `runs` holding that figure of every round in round
 * order, so report.ts compares two kinds round by round: both runs of a round ran within seconds of
 * each other, where running one kind's REPEATS runs back to back put minutes between the two sides of
 * a ratio.
 */
async function rounds<K extends string>(kinds: K[], run: (kind: K) => Promise<Row>): Promise<Record<K, Row & { runs: number[] }>> {
  const by = (row: Row) => Number(row.handoffP50Ms ?? row.p50Ms);
  const runs = new Map<K, Row[]>(kinds.map((k) => [k, []]));
  for (let r = 0; r < REPEATS; r++) {
    for (const kind of rotated(kinds, r)) runs.get(kind)!.push(await run(kind));
    log('round', r + 1, 'of', REPEATS, Object.fromEntries([...runs].map(([k, list]) => [k, by(list.at(-1)!)])));
  }
  const out = {} as Record<K, Row & { runs: number[] }>;
  for (const [kind, list] of runs) out[kind] = medianRun(list, by);
  return out;
}

let keySeq = 0;
const freshKey = () => `bench:${process.pid}:${++keySeq}`;

async function pingRoundTrip(url: string, count = 2_000): Promise<Row> {
  const client = new Redis(url);
  const { latencies, elapsedMs } = await timedPings(client, 1, count, 200);
  await client.quit();
  return pingFigures(latencies, elapsedMs);
}

// 1. One client, sequential acquire + release on fresh keys (one slice: 1 worker x 500 pairs), and
// 2. 64 concurrent workers on distinct keys (64 workers x 40 pairs): `workers` loops of `pairsEach` pairs.
async function pairs(locker: Locker, workers: number, pairsEach: number): Promise<Slice> {
  const { latencies, elapsedMs } = await timedLoops(workers, pairsEach, async () => (await locker.acquire(freshKey()))());
  return { rate: ((workers * pairsEach) / elapsedMs) * 1000, latencies };
}

// 3. 8 contenders on one key, in 1 process x 8 or 2 processes x 4.
interface Events {
  acquisitions: { worker: string; at: number }[];
  releases: number[];
  /** How long each release took, from its start to its reply. */
  releaseMs: number[];
}

/** `processes` contender children (bench/contender.ts) of `kind` on `key`, 8 workers between them. */
async function contenders(kind: LockerKind, url: string, key: string, processes: number) {
  const children = Array.from({ length: processes }, (_, p) =>
    fork(join(here, 'contender.js'), [kind, url, key, String(8 / processes), String(p)], { stdio: ['ignore', 'inherit', 'inherit', 'ipc'] }),
  );
  const next = (child: (typeof children)[number], type: string) =>
    new Promise<Record<string, unknown>>((resolve, reject) => {
      const onExit = (code: number | null) => reject(new Error(`contender exited (${code}) before "${type}"`));
      const onMessage = (m: Record<string, unknown>) => {
        if (m.type !== type) return;
        child.off('message', onMessage);
        child.off('exit', onExit);
        resolve(m);
      };
      child.on('message', onMessage);
      child.once('exit', onExit);
    });
  await Promise.all(children.map((c) => next(c, 'ready')));
  return {
    /** Sends `message` to every child and resolves to their replies of type `reply`. */
    ask: (message: Record<string, unknown>, reply: string) => {
      const replies = children.map((c) => next(c, reply));
      for (const c of children) c.send(message);
      return Promise.all(replies);
    },
    stop: async () => {
      for (const c of children) c.send({ type: 'stop' });
      await Promise.all(children.map((c) => new Promise((resolve) => (c.exitCode !== null ? resolve(null) : c.once('exit', resolve)))));
    },
  };
}

/**
 * PING round trips at scenario 3's concurrency: in the same topology as its contenders (`processes`
 * children, 8 workers between them, one client per process), every worker sends `count` PINGs one
 * after another, all at once. The raw limit includes "PING round trips, at the same
 * concurrency"; scenario 1's PING (one caller) is the other reading.
 */
async function concurrentPing(url: string, processes: number, count = 500): Promise<Row> {
  const children = await contenders('raw', url, freshKey(), processes);
  try {
    const replies = await children.ask({ type: 'ping', count }, 'pings');
    const latencies = replies.flatMap((m) => m.latencies as number[]);
    // The rate over the longest child's timed part: their warm-ups and the IPC are left out.
    const elapsedMs = Math.max(...replies.map((m) => m.elapsedMs as number));
    return pingFigures(latencies, elapsedMs);
  } finally {
    await children.stop();
  }
}

async function contended(kind: LockerKind, url: string, processes: number, budgetMs = 2_000): Promise<Row> {
  const children = await contenders(kind, url, freshKey(), processes);
  const everyone = async (message: Record<string, unknown>): Promise<Events> => {
    const all = (await children.ask(message, 'events')) as unknown as Events[];
    return {
      acquisitions: all.flatMap((e) => e.acquisitions).sort((a, b) => a.at - b.at),
      releases: all.flatMap((e) => e.releases).sort((a, b) => a - b),
      releaseMs: all.flatMap((e) => e.releaseMs),
    };
  };

  // Handoff latency: rounds in which each worker takes the lock once. Every acquisition after the
  // first of a round is a waiter getting the lock; its handoff starts when the previous holder
  // started to release.
  const handoffs: number[] = [];
  const releaseTimes: number[] = [];
  let acquired = 0;
  let roundTime = 0;
  for (let round = 0; round < 3 || roundTime < budgetMs; round++) {
    const started = performance.now();
    const { acquisitions, releases, releaseMs } = await everyone({ type: 'round' });
    roundTime += performance.now() - started;
    acquired += acquisitions.length;
    releaseTimes.push(...releaseMs);
    for (let i = 1; i < acquisitions.length; i++) {
      const previous = releases.filter((t) => t <= acquisitions[i]!.at).at(-1);
      if (previous !== undefined) handoffs.push(acquisitions[i]!.at - previous);
    }
    if (round >= 50) break;
  }

  // Fairness: a tight loop (acquire, hold, release, retry at once) for the same budget.
  const { acquisitions } = await everyone({ type: 'loop', until: performance.timeOrigin + performance.now() + budgetMs });
  const perWorker = new Map<string, number>();
  for (const a of acquisitions) perWorker.set(a.worker, (perWorker.get(a.worker) ?? 0) + 1);
  const counts = Array.from({ length: processes }, (_, p) => Array.from({ length: 8 / processes }, (_, w) => perWorker.get(`${p}:${w}`) ?? 0)).flat();
  let switches = 0;
  for (let i = 1; i < acquisitions.length; i++) if (acquisitions[i]!.worker !== acquisitions[i - 1]!.worker) switches++;

  await children.stop();
  return {
    acquisitionsPerSec: round((acquired / roundTime) * 1000, 0),
    handoffP50Ms: round(percentile(handoffs, 50), 3),
    handoffP99Ms: round(percentile(handoffs, 99), 3),
    // The release's own round trip (start to reply), in the same rounds as the handoffs.
    releaseP50Ms: round(percentile(releaseTimes, 50), 3),
    loopAcquisitionsPerSec: round((acquisitions.length / budgetMs) * 1000, 0),
    fairness: round(jain(counts), 3),
    handoffsToAnotherWorker: round(acquisitions.length > 1 ? switches / (acquisitions.length - 1) : 0, 3),
  };
}

// 4. A @Locked HTTP endpoint under load, against no lock and a hand-written lock: one slice is
// `sliceS` seconds of autocannon on one endpoint.
async function http(url: string, sliceS = 2): Promise<Record<string, Row>> {
  const app = await startHttpApp(url);
  const endpoints = ['none', 'locked', 'manual', 'service', 'interceptor'] as const;
  try {
    return await sliced(
      [...endpoints],
      async (endpoint) => endpoint,
      async (endpoint) => {
        const r = await app.load(endpoint, sliceS);
        return { rate: r.requests.average, medians: { p99Ms: r.latency.p99 }, sums: { errors: r.errors + r.non2xx } };
      },
      async () => {},
      'requestsPerSec',
    );
  } finally {
    await app.stop();
  }
}

// 5. 10 000 locks held at once under the watchdog.
async function manyHeld(url: string, count = 10_000, leaseMs = 3_000): Promise<Row> {
  const gc = (globalThis as { gc?: () => void }).gc;
  if (!gc) throw new Error('run with --expose-gc');
  // Its own database (1), emptied first: Redis's memory is measured before the locks, while they
  // are held, and after their release (what stays: the fencing counters, for an hour).
  const db = `${url}/1`;
  const raw = new Redis(db);
  // SYNC: where flushes free memory lazily (Valkey 8's default), Redis's memory would still count the old keys.
  await raw.flushdb('SYNC');
  const redisUsed = async () => Number(/used_memory:(\d+)/.exec(await raw.info('memory'))?.[1]);
  const locks = new LockService({ redis: db, leaseMs, waitMs: 0 });
  await locks.onModuleInit();
  gc();
  const heapBefore = process.memoryUsage().heapUsed;
  const redisBefore = await redisUsed();
  const handles = [];
  for (let i = 0; i < count; i += 500) {
    handles.push(...(await Promise.all(Array.from({ length: Math.min(500, count - i) }, () => locks.acquire(freshKey())))));
  }
  gc();
  const heapAfter = process.memoryUsage().heapUsed;
  const redisHeld = await redisUsed();
  await raw.config('RESETSTAT');
  const delay = monitorEventLoopDelay({ resolution: 10 });
  delay.enable();
  const periods = 3;
  const started = performance.now();
  await new Promise((r) => setTimeout(r, (periods * leaseMs) / 3 + 100));
  delay.disable();
  const elapsedPeriods = (performance.now() - started) / (leaseMs / 3);
  const calls = await scriptCalls(raw);
  // Redis's own time in the scripts of the window (the renewals), per lock renewed: commandstats
  // counts the commands scripts call too, and each renewal sets its lock's lease with one PEXPIRE.
  const stats = await raw.info('commandstats');
  const scriptUsec = [...stats.matchAll(/cmdstat_eval(?:sha)?:calls=\d+,usec=(\d+)/g)].reduce((sum, m) => sum + Number(m[1]), 0);
  const renewed = Number(/cmdstat_pexpire:calls=(\d+)/.exec(stats)?.[1] ?? Number.NaN);
  const lost = handles.filter((h) => h.signal.aborted).length;
  await Promise.all(handles.map((h) => h.release()));
  const redisLeft = await redisUsed();
  await locks.onApplicationShutdown();
  await raw.quit();
  return {
    locks: count,
    redisCallsPerRenewalPeriod: round(calls / elapsedPeriods, 1),
    redisUsPerRenewedLock: round(scriptUsec / renewed, 2),
    targetCallsPerPeriod: Math.ceil(count / 100),
    eventLoopDelayP99Ms: round(delay.percentile(99) / 1e6, 2),
    heapBytesPerLock: round((heapAfter - heapBefore) / count, 0),
    redisBytesPerHeldLock: round((redisHeld - redisBefore) / count, 0),
    redisBytesPerReleasedKey: round((redisLeft - redisBefore) / count, 0),
    lost,
  };
}

async function main() {
  const redis = await RedisServer.start();
  const url = redis.url;
  const results: Record<string, unknown> = {
    ...(await measuredOn(redis.client())),
    repeats: REPEATS,
    slices: SLICES,
    command: 'npm run bench',
  };
  try {
    const simple: LockerKind[] = ['raw', 'nestjs-locked', 'redlock', 'sesame-redlock', 'redis-semaphore'];
    if (ONLY.includes(1)) {
      log('1. sequential');
      const ping = await repeated(() => pingRoundTrip(url), 'pingsPerSec');
      results.sequential = { ping, ...(await sliced([...simple, 'nestjs-locked-no-fencing', 'scripts'], (kind) => makeLocker(kind, url), (_, locker) => pairs(locker, 1, 500), (locker) => locker.close(), 'pairsPerSec')) };
    }
    if (ONLY.includes(2)) {
      log('2. 64 concurrent workers');
      results.concurrent = await sliced([...simple, 'raw-batched'], (kind) => makeLocker(kind, url), (_, locker) => pairs(locker, 64, 40), (locker) => locker.close(), 'pairsPerSec');
    }
    if (ONLY.includes(3)) {
      const kinds: LockerKind[] = ['raw', 'nestjs-locked', 'nestjs-locked-fair', 'redlock', 'redlock-10ms', 'sesame-redlock', 'sesame-redlock-10ms', 'redis-semaphore'];
      const s3 = {} as Record<string, Record<string, Row>>;
      const pings = {} as Record<string, Row>;
      const solo = {} as Record<string, Row>;
      for (const processes of [1, 2]) {
        const topology = processes === 1 ? '1x8' : '2x4';
        log('3. contended', topology);
        const rows = await rounds([...kinds, 'ping', 'ping-one-caller'], (kind) =>
          kind === 'ping' ? concurrentPing(url, processes) : kind === 'ping-one-caller' ? pingRoundTrip(url) : contended(kind, url, processes),
        );
        const { ping, 'ping-one-caller': oneCaller, ...locks } = rows;
        s3[topology] = locks;
        pings[topology] = ping!;
        solo[topology] = oneCaller!;
      }
      results.contended = s3;
      results.contendedPing = pings;
      results.contendedPingOneCaller = solo;
      results.contendedRounds = REPEATS;
    }
    if (ONLY.includes(4)) results.http = await http(url);
    if (ONLY.includes(5)) {
      results.manyHeld = await repeated(() => manyHeld(url), 'eventLoopDelayP99Ms');
      log('10 000 held', results.manyHeld);
    }
  } finally {
    await redis.stop();
  }
  const file = join(repoRoot, 'bench', 'results', ONLY.length === 5 ? 'latest.json' : `partial-${ONLY.join('-')}.json`);
  writeFileSync(file, JSON.stringify(results, null, 2) + '\n');
  log('wrote', file);
  if (ONLY.length === 5) {
    writeReport(JSON.parse(readFileSync(file, 'utf8')), join(repoRoot, 'BENCHMARKS.md'));
    log('wrote BENCHMARKS.md');
  }
}

await main();
