// `npm run bench:profile`: where an acquire + release pair spends its time, for the throughput
// scenarios (1: sequential, 2: 64 concurrent workers). Instead of pairs/s, which moves with
// whatever else this shared machine runs, it counts what a pair costs:
// - Node CPU microseconds per pair (process.cpuUsage: this process, ioredis included),
// - Redis commands per pair and Redis CPU microseconds per pair (INFO commandstats; INFO cpu),
// for the raw limit, nestjs-locked, and `scripts`: nestjs-locked's own two Lua scripts sent by a
// bare ioredis client (no LockService), which separates what Redis does from what Node does.
// Interleaved over PROFILE_ROUNDS rounds (median kept); PROFILE_PAIRS sets scenario 1's pairs per
// kind and round (default 4,000): fewer pairs and more rounds keep the kinds a round compares closer
// together in time on a machine whose speed moves from one second to the next. PROFILE_OUT=file
// writes the medians as JSON, with the rounds and scenario 1's pairs under `settings`
// (PROFILE_HTTP_OUT=file those of scenario 4); every file written has the date, the machine and the
// command under `measured`.
// PROFILE_CPU=1 also records a V8 CPU profile of nestjs-locked's runs (.tmp/bench-profile.cpuprofile,
// open it in Chrome DevTools) and prints the functions with the most self time.
// Scenario 4 (the HTTP endpoints of `npm run bench`, autocannon with 16 connections): requests/s,
// and the CPU time per request of the app's process (process.cpuUsage, asked over IPC) and of Redis
// (INFO cpu), which tells the decorator's own cost from the lock's cost in Redis.
// PROFILE_SCENARIOS picks the parts (default `1,2,4`).
// PROFILE_KINDS picks the kinds (default `raw,scripts,nestjs-locked`); besides the lockers of
// bench/lockers.ts, `scripts-empty`, `scripts-no-fencing`, `scripts-no-announcement` and
// `scripts-hold-count-only` are the bare scripts with parts taken out (bench/our-scripts.ts), which
// tells what each part costs in time; `nestjs-locked-hold-count-only` is LockService keeping only the
// hold count (see holdCountOnlyService); `nestjs-locked-store` is nestjs-locked's store driven
// without LockService (see storeOnly).
// Each kind's `vsRaw` is the median over the rounds of its pairs/s over the raw limit's in the same
// round (when `raw` is one of the kinds).
// PROFILE_ALLOC=1 also counts the bytes the Node process allocates per sequential pair, by function
// (V8's sampling heap profiler, keeping the objects that were collected since), for each kind;
// PROFILE_ALLOC_OUT=file writes the totals as JSON.
import { Session } from 'node:inspector/promises';
import { mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { Redis } from 'ioredis';
import { RedisServer } from '../test/support/redis-server.js';
import { FENCE_COUNTER_TTL_MS, RELEASE } from '../lib/store/redis/lock.scripts.js';
import { RedisLockStore } from '../lib/store/redis/redis-lock.store.js';
import { RedisScript } from '../lib/store/redis/redis-script.js';
import { startHttpApp } from './http-app-child.js';
import { LockService } from '../lib/index.js';
import { RELEASE_NO_ANNOUNCEMENT, SCRIPT_VARIANTS, type ScriptVariant } from './our-scripts.js';
import { makeLocker, scriptsLocker, serviceLocker, type Locker, type LockerKind } from './lockers.js';
import { measuredOn, median, round } from './stats.js';
import { repoRoot } from '../test/support/paths.js';

const ROUNDS = Number(process.env.PROFILE_ROUNDS ?? 5);
const SEQUENTIAL_PAIRS = Number(process.env.PROFILE_PAIRS ?? 4_000);
type Kind = LockerKind | ScriptVariant | 'nestjs-locked-hold-count-only' | 'nestjs-locked-store';
const KINDS = (process.env.PROFILE_KINDS ?? 'raw,scripts,nestjs-locked').split(',') as Kind[];
const SCENARIOS = (process.env.PROFILE_SCENARIOS ?? '1,2,4').split(',').map(Number);
const HTTP_ENDPOINTS = ['none', 'locked', 'manual', 'service'] as const;
const HTTP_SECONDS = 3;
let keySeq = 0;
const freshKey = () => `profile:${++keySeq}`;

interface Cost {
  pairsPerSec: number;
  nodeCpuUsPerPair: number;
  redisCpuUsPerPair: number;
  redisCommandsPerPair: number;
  commands: Record<string, number>;
  /** The median of the per-round ratios of pairs/s to the raw limit's. */
  vsRaw?: number;
}

async function redisCounters(admin: Redis): Promise<{ cpuUs: number; calls: Record<string, number> }> {
  const cpu = await admin.info('cpu');
  const cpuUs = ['used_cpu_sys', 'used_cpu_user'].reduce((s, f) => s + Number(new RegExp(`${f}:([\\d.]+)`).exec(cpu)?.[1] ?? 0) * 1e6, 0);
  const calls: Record<string, number> = {};
  for (const m of (await admin.info('commandstats')).matchAll(/cmdstat_([\w|]+):calls=(\d+)/g)) calls[m[1]!] = Number(m[2]);
  return { cpuUs, calls };
}

/**
 * LockService keeping the hold count only, as `scripts-hold-count-only` keeps it from a bare client:
 * `fencingTokens: false` (its acquire then skips TIME and the counter) on a client that runs the
 * release without announcement wherever LockService asks for its release script. It measures what
 * LockService would cost on top of that data model; it wakes no waiter (for scenario 1 only), and
 * the library never runs it.
 */
async function holdCountOnlyService(url: string): Promise<Locker> {
  const client = new Redis(url);
  const lean = (await client.script('LOAD', RELEASE_NO_ANNOUNCEMENT)) as string;
  // The SHA the store sends RELEASE by, computed where the store computes it.
  const release = new RedisScript('release', RELEASE).sha;
  const evalsha = client.evalsha.bind(client) as (sha: string, ...rest: unknown[]) => Promise<unknown>;
  Object.assign(client, { evalsha: (sha: string, ...rest: unknown[]) => evalsha(sha === release ? lean : sha, ...rest) });
  return serviceLocker(new LockService({ redis: client, waitMs: Infinity, fencingTokens: false }), undefined, () => client.quit());
}

/**
 * nestjs-locked's store (RedisLockStore, the layer that sends the scripts: its bookkeeping of steps
 * in flight, the script wrapper, the reply's reading) driven directly with the requests LockService
 * makes for an uncontended acquire and release, without LockService: tells what the store costs on
 * top of the bare scripts (`scripts`) from what LockService costs on top of the store.
 */
async function storeOnly(url: string): Promise<Locker> {
  const client = new Redis(url);
  const store = new RedisLockStore(client, false, 'lock:', { debug: () => undefined, warn: () => undefined }, undefined, FENCE_COUNTER_TTL_MS);
  await store.ready(5_000);
  const holdsHere = () => undefined;
  // As LockService's release of a last hold passes one (nothing waits here, so it is never read).
  const takeAlong = { noticed: Promise.resolve() };
  let owner = 0;
  return {
    acquire: async (key) => {
      const id = `store-${++owner}`;
      const r = await store.acquire({ key, owner: id, leaseMs: 30_000, mode: 'exclusive', holdsHere });
      if (!r.granted) throw new Error(`store kind: "${key}" was not granted`);
      return async () => void (await store.release(key, id, 'exclusive', takeAlong, holdsHere, false));
    },
    close: async () => {
      await store.close();
      await client.quit();
    },
  };
}

function makeKind(kind: Kind, url: string): Promise<Locker> {
  if (kind === 'nestjs-locked-hold-count-only') return holdCountOnlyService(url);
  if (kind === 'nestjs-locked-store') return storeOnly(url);
  if (kind in SCRIPT_VARIANTS) {
    const variant = SCRIPT_VARIANTS[kind as ScriptVariant];
    return scriptsLocker(url, variant.acquire, variant.release);
  }
  return makeLocker(kind as LockerKind, url);
}

async function measure(kind: Kind, url: string, admin: Redis, workers: number, pairs: number): Promise<Cost> {
  const locker = await makeKind(kind, url);
  await Promise.all(Array.from({ length: workers }, async () => (await locker.acquire(freshKey()))()));
  const perWorker = Math.ceil(pairs / workers);
  const before = await redisCounters(admin);
  const cpu = process.cpuUsage();
  const started = performance.now();
  await Promise.all(
    Array.from({ length: workers }, async () => {
      for (let i = 0; i < perWorker; i++) await (await locker.acquire(freshKey()))();
    }),
  );
  const elapsed = performance.now() - started;
  const used = process.cpuUsage(cpu);
  const after = await redisCounters(admin);
  await locker.close();
  const total = perWorker * workers;
  const commands: Record<string, number> = {};
  let count = 0;
  for (const [name, calls] of Object.entries(after.calls)) {
    // The two INFO calls of this measurement are not the lock's.
    const n = calls - (before.calls[name] ?? 0) - (name === 'info' ? 2 : 0);
    if (n > 0) {
      commands[name] = round(n / total, 3);
      count += n;
    }
  }
  return {
    pairsPerSec: round((total / elapsed) * 1000, 0),
    nodeCpuUsPerPair: round((used.user + used.system) / total, 1),
    redisCpuUsPerPair: round((after.cpuUs - before.cpuUs) / total, 1),
    redisCommandsPerPair: round(count / total, 2),
    commands,
  };
}

interface HttpCost {
  requestsPerSec: number;
  appCpuUsPerRequest: number;
  redisCpuUsPerRequest: number;
  /** The median over the rounds of this endpoint's app CPU per request over the hand-written lock's in the same round. */
  appCpuVsManual?: number;
  /** The same for Redis CPU per request. */
  redisCpuVsManual?: number;
}

/** Scenario 4's endpoints, interleaved over ROUNDS rounds: requests/s and CPU per request of the app and of Redis. */
async function profileHttp(url: string, admin: Redis): Promise<Record<string, HttpCost>> {
  const app = await startHttpApp(url);
  for (const endpoint of HTTP_ENDPOINTS) await app.load(endpoint, 1); // warm-up
  const runs = new Map<string, HttpCost[]>(HTTP_ENDPOINTS.map((e) => [e, []]));
  for (let r = 0; r < ROUNDS; r++) {
    for (const endpoint of HTTP_ENDPOINTS.map((_, i) => HTTP_ENDPOINTS[(i + r) % HTTP_ENDPOINTS.length]!)) {
      const [app0, redis0] = [await app.cpuUs(), await redisCounters(admin)];
      const result = await app.load(endpoint, HTTP_SECONDS);
      const [app1, redis1] = [await app.cpuUs(), await redisCounters(admin)];
      const requests = result.requests.total;
      runs.get(endpoint)!.push({
        requestsPerSec: round(result.requests.average, 0),
        appCpuUsPerRequest: round((app1 - app0) / requests, 1),
        redisCpuUsPerRequest: round((redis1.cpuUs - redis0.cpuUs) / requests, 1),
      });
    }
  }
  await app.stop();
  type Measured = 'requestsPerSec' | 'appCpuUsPerRequest' | 'redisCpuUsPerRequest';
  // CPU time per request moves with the machine's load too; rounds compare endpoints measured seconds apart.
  const manual = runs.get('manual')!;
  const out: Record<string, HttpCost> = {};
  for (const [endpoint, costs] of runs) {
    const pick = (f: Measured) => median(costs.map((c) => c[f]));
    const vsManual = (f: Measured) => round(median(costs.map((c, r) => c[f] / manual[r]![f])), 3);
    out[endpoint] = {
      requestsPerSec: pick('requestsPerSec'),
      appCpuUsPerRequest: pick('appCpuUsPerRequest'),
      redisCpuUsPerRequest: pick('redisCpuUsPerRequest'),
      appCpuVsManual: vsManual('appCpuUsPerRequest'),
      redisCpuVsManual: vsManual('redisCpuUsPerRequest'),
    };
  }
  return out;
}

interface CallFrame {
  functionName: string;
  url: string;
  lineNumber: number;
}

/** "function file:line" of a V8 profile's call frame, the file relative to node_modules or the build. */
const frameLabel = (f: CallFrame) => `${f.functionName || '(anonymous)'} ${f.url.replace(/^.*(node_modules|\.bench-build)\//, '')}:${f.lineNumber + 1}`;

interface HeapNode {
  callFrame: CallFrame;
  selfSize: number;
  children: HeapNode[];
}

/**
 * Bytes allocated per sequential pair by each kind, and the functions that allocate most. Every kind
 * is warmed up first, so all run with LockService's AsyncLocalStorage enabled (Node then tracks
 * every promise), as they would in an app that uses it.
 */
async function allocations(url: string, pairs = 3_000): Promise<Record<string, { bytesPerPair: number; top: string[] }>> {
  const session = new Session();
  session.connect();
  const lockers = new Map<Kind, Locker>();
  for (const kind of KINDS) lockers.set(kind, await makeKind(kind, url));
  const out: Record<string, { bytesPerPair: number; top: string[] }> = {};
  try {
    for (const locker of lockers.values()) for (let i = 0; i < 500; i++) await (await locker.acquire(freshKey()))();
    for (const [kind, locker] of lockers) {
      await session.post('HeapProfiler.startSampling', { samplingInterval: 256, includeObjectsCollectedByMajorGC: true, includeObjectsCollectedByMinorGC: true } as never);
      for (let i = 0; i < pairs; i++) await (await locker.acquire(freshKey()))();
      const { profile } = (await session.post('HeapProfiler.stopSampling')) as unknown as { profile: { head: HeapNode } };
      const bySite = new Map<string, number>();
      let total = 0;
      const walk = (node: HeapNode) => {
        const site = frameLabel(node.callFrame);
        total += node.selfSize;
        if (node.selfSize) bySite.set(site, (bySite.get(site) ?? 0) + node.selfSize);
        node.children.forEach(walk);
      };
      walk(profile.head);
      const top = [...bySite].sort((a, b) => b[1] - a[1]).slice(0, 12).map(([site, bytes]) => `${String(Math.round(bytes / pairs)).padStart(6)} B  ${site}`);
      out[kind] = { bytesPerPair: Math.round(total / pairs), top };
    }
  } finally {
    session.disconnect();
    for (const locker of lockers.values()) await locker.close();
  }
  return out;
}

/** Self time per function of a V8 CPU profile, top `n`. */
function topSelfTime(profile: { nodes: { id: number; callFrame: CallFrame }[]; samples: number[]; timeDeltas: number[] }, n: number) {
  const byId = new Map(profile.nodes.map((node) => [node.id, node]));
  const self = new Map<string, number>();
  let total = 0;
  profile.samples.forEach((id, i) => {
    const name = frameLabel(byId.get(id)!.callFrame);
    const dt = profile.timeDeltas[i] ?? 0;
    self.set(name, (self.get(name) ?? 0) + dt);
    total += dt;
  });
  return [...self.entries()]
    .sort((a, b) => b[1] - a[1])
    .slice(0, n)
    .map(([name, us]) => `${((us / total) * 100).toFixed(1).padStart(5)}%  ${name}`);
}

async function main() {
  const redis = await RedisServer.start();
  const admin = new Redis(redis.url);
  const session = process.env.PROFILE_CPU ? new Session() : undefined;
  if (session) {
    session.connect();
    await session.post('Profiler.enable');
    await session.post('Profiler.setSamplingInterval', { interval: 100 });
  }
  // When, where and how: written into each results file (the report names them).
  const command = [...Object.entries(process.env).filter(([k]) => k.startsWith('PROFILE_') && !k.endsWith('OUT')).map(([k, v]) => `${k}=${v}`).sort(), 'npm run bench:profile'].join(' ');
  const measured = { ...(await measuredOn(admin)), command };
  const out: Record<string, Record<string, Cost>> = {};
  let http: Record<string, HttpCost> | undefined;
  let alloc: Awaited<ReturnType<typeof allocations>> | undefined;
  try {
    for (const [scenario, workers, pairs] of [
      ['1 sequential', 1, SEQUENTIAL_PAIRS],
      ['2 64 workers', 64, 12_800],
    ] as const) {
      if (!SCENARIOS.includes(Number(scenario[0]))) continue;
      const runs = new Map<Kind, Cost[]>(KINDS.map((k) => [k, []]));
      for (let r = 0; r < ROUNDS; r++) {
        for (const kind of r % 2 ? [...KINDS].reverse() : KINDS) {
          const profiled = session && kind.startsWith('nestjs-locked');
          if (profiled) await session.post('Profiler.start');
          runs.get(kind)!.push(await measure(kind, redis.url, admin, workers, pairs));
          if (profiled) {
            const { profile } = await session.post('Profiler.stop');
            mkdirSync(join(repoRoot, '.tmp'), { recursive: true });
            const file = join(repoRoot, '.tmp', `bench-profile-${kind}-${workers}.cpuprofile`);
            writeFileSync(file, JSON.stringify(profile));
            if (r === ROUNDS - 1) console.log(`\n${scenario}, ${kind}: self time (${file})\n${topSelfTime(profile as never, 25).join('\n')}`);
          }
        }
      }
      out[scenario] = {};
      for (const [kind, costs] of runs) {
        const pick = (f: keyof Cost) => median(costs.map((c) => c[f] as number));
        out[scenario]![kind] = {
          pairsPerSec: pick('pairsPerSec'),
          nodeCpuUsPerPair: pick('nodeCpuUsPerPair'),
          redisCpuUsPerPair: pick('redisCpuUsPerPair'),
          redisCommandsPerPair: pick('redisCommandsPerPair'),
          commands: costs[Math.floor(costs.length / 2)]!.commands,
        };
        const raw = runs.get('raw');
        if (raw && kind !== 'raw') out[scenario]![kind]!.vsRaw = round(median(costs.map((c, i) => c.pairsPerSec / raw[i]!.pairsPerSec)), 3);
      }
    }
    if (SCENARIOS.includes(4)) http = await profileHttp(redis.url, admin);
    if (process.env.PROFILE_ALLOC) alloc = await allocations(redis.url);
  } finally {
    session?.disconnect();
    await admin.quit();
    await redis.stop();
  }
  for (const [scenario, kinds] of Object.entries(out)) {
    console.log(`\n${scenario} (median of ${ROUNDS} interleaved rounds)`);
    console.log('lock'.padEnd(29), 'pairs/s'.padStart(9), 'vs raw'.padStart(7), 'node us/pair'.padStart(13), 'redis us/pair'.padStart(14), 'cmds/pair'.padStart(10), ' commands per pair');
    for (const [kind, c] of Object.entries(kinds)) {
      console.log(
        kind.padEnd(29),
        String(c.pairsPerSec).padStart(9),
        String(c.vsRaw ?? '').padStart(7),
        String(c.nodeCpuUsPerPair).padStart(13),
        String(c.redisCpuUsPerPair).padStart(14),
        String(c.redisCommandsPerPair).padStart(10),
        ' ' + Object.entries(c.commands).map(([k, v]) => `${k} ${v}`).join(', '),
      );
    }
  }
  if (http) {
    console.log(`\n4 http (median of ${ROUNDS} interleaved rounds of ${HTTP_SECONDS} s, 16 connections)`);
    console.log('endpoint'.padEnd(10), 'requests/s'.padStart(11), 'app CPU us/request'.padStart(19), 'Redis CPU us/request'.padStart(21), 'app CPU vs manual'.padStart(18), 'Redis CPU vs manual'.padStart(20));
    for (const [endpoint, c] of Object.entries(http)) {
      console.log(endpoint.padEnd(10), String(c.requestsPerSec).padStart(11), String(c.appCpuUsPerRequest).padStart(19), String(c.redisCpuUsPerRequest).padStart(21), String(c.appCpuVsManual).padStart(18), String(c.redisCpuVsManual).padStart(20));
    }
  }
  if (alloc) {
    console.log('\nbytes allocated by Node per sequential pair (sampling heap profiler, collected objects included)');
    for (const [kind, a] of Object.entries(alloc)) console.log(`${kind}: ${a.bytesPerPair} B per pair\n${a.top.join('\n')}`);
    if (process.env.PROFILE_ALLOC_OUT) writeFileSync(process.env.PROFILE_ALLOC_OUT, JSON.stringify({ measured, ...Object.fromEntries(Object.entries(alloc).map(([k, a]) => [k, a.bytesPerPair])) }, null, 2) + '\n');
  }
  if (process.env.PROFILE_OUT) writeFileSync(process.env.PROFILE_OUT, JSON.stringify({ settings: { rounds: ROUNDS, sequentialPairs: SEQUENTIAL_PAIRS }, measured, ...out }, null, 2) + '\n');
  if (process.env.PROFILE_HTTP_OUT && http) writeFileSync(process.env.PROFILE_HTTP_OUT, JSON.stringify({ measured, ...http }, null, 2) + '\n');
}

await main();
