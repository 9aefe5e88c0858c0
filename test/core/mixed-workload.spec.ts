import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { AsyncResource } from 'node:async_hooks';
import { LockNotAcquiredError, type LockHandle, type LockModuleOptions, type LockService } from '../../lib/index.js';
import { RedisCluster } from '../support/redis-cluster.js';
import { RedisServer } from '../support/redis-server.js';
import { startLockApp, type LockApp } from '../support/lock-testing.js';

/**
 * Every kind of lock at once, nested at random: plain locks (by `run()` and by `acquire()`), their
 * re-entries, multi-key groups, both sides of read-write locks (a writer also reading), and fair
 * locks, taken by 3 LockServices (3 processes, as far as Redis can tell) with 4 workers each, on
 * one Redis server, a 3-master Redis Cluster (groups then span slots) and the Redlock quorum over
 * 3 servers (no fair mode or fencing tokens there), and by 12 workers of one LockService on the
 * memory store (its locks are its own process's). A checker in this process sees every protected
 * section enter and leave, and holds the library to what it promises while nothing fails:
 * - no two owners ever inside the same key at once, but readers with readers;
 * - each hold count is the number of holds this owner has on that side of the key;
 * - each fresh grant of a key carries a larger fencing token than every grant before it;
 * - once everything is released, Redis holds nothing of any lock (only the fencing counters).
 */

const SEED = 20261127;
const SERVICES = 3;
const WORKERS = 4;
const OPS = 30; // top-level operations per worker; each may nest up to 2 more

const PLAIN = ['a', 'b', 'c', 'd', 'e', 'f'];
const READ_WRITE = ['rw1', 'rw2'];
const FAIR = ['f1', 'f2'];

type Side = 'exclusive' | 'read' | 'write';

class Checker {
  readonly violations: string[] = [];
  /** key -> `${owner} ${side}` -> holds inside */
  private readonly inside = new Map<string, Map<string, { owner: string; side: Side; count: number; handle: LockHandle }>>();
  private readonly lastToken = new Map<string, number>();
  readersTogether = 0;

  constructor(private readonly tokens: boolean) {}

  enter(handle: LockHandle): void {
    const { key, owner, mode: side } = handle;
    const here = this.inside.get(key) ?? this.inside.set(key, new Map()).get(key)!;
    for (const other of here.values()) {
      if (other.owner === owner) continue;
      if (side === 'read' && other.side === 'read') {
        this.readersTogether++;
        continue;
      }
      this.violations.push(`${side} hold of ${key} by ${owner} while ${other.owner} held its ${other.side} side`);
    }
    const id = `${owner} ${side}`;
    const mine = here.get(id) ?? here.set(id, { owner, side, count: 0, handle }).get(id)!;
    mine.count++;
    if (handle.holdCount !== mine.count) this.violations.push(`${key} ${side} by ${owner}: hold count ${handle.holdCount}, ${mine.count} holds inside`);
    if (this.tokens && handle.holdCount === 1 && side !== 'read') {
      const last = this.lastToken.get(key) ?? -1;
      if (!(handle.fencingToken > last)) this.violations.push(`${key}: fencing token ${handle.fencingToken} after ${last}`);
      this.lastToken.set(key, handle.fencingToken);
    }
  }

  leave(handle: LockHandle): void {
    const here = this.inside.get(handle.key)!;
    const id = `${handle.owner} ${handle.mode}`;
    if (--here.get(id)!.count === 0) here.delete(id);
  }
}

/** A small deterministic generator (the run is the same every time, given the same timings). */
function random(seed: number): () => number {
  let state = seed;
  return () => {
    state = (state * 1103515245 + 12345) & 0x7fffffff;
    return state / 0x7fffffff;
  };
}

describe.each(['redis', 'cluster', 'redlock', 'memory'] as const)('every kind of lock at once, nested at random, on the %s store', (store) => {
  let servers: RedisServer[] = [];
  let cluster: RedisCluster | undefined;
  const apps: LockApp[] = [];

  beforeAll(async () => {
    let options: LockModuleOptions = { store: 'memory' };
    if (store === 'redis') servers = [await RedisServer.start()];
    if (store === 'cluster') cluster = await RedisCluster.start();
    if (store === 'redlock') servers = await Promise.all([0, 1, 2].map(() => RedisServer.start()));
    if (store === 'redis') options = { redis: servers[0]!.url };
    if (store === 'cluster') options = { redis: { cluster: cluster!.nodes } };
    if (store === 'redlock') options = { redlock: { clients: servers.map((s) => s.url) } };
    for (let i = 0; i < (store === 'memory' ? 1 : SERVICES); i++) apps.push(await startLockApp({ ...options, leaseMs: 600 }));
  });
  afterAll(async () => {
    for (const app of apps) await app.close();
    await cluster?.stop();
    await Promise.all(servers.map((s) => s.stop()));
  });

  /** Every key of every Redis server the locks live on but the fencing counters. */
  const leftInRedis = async () => {
    const nodes = cluster ? cluster.servers : servers;
    const keys = (await Promise.all(nodes.map((node) => node.shared().keys('lock:*')))).flat();
    return keys.filter((k) => !k.endsWith(':fence'));
  };

  it(`keeps owners apart and counts right: ${SERVICES * WORKERS} workers x ${OPS} operations`, async () => {
    const next = random(SEED);
    const pick = <T>(from: readonly T[]): T => from[Math.floor(next() * from.length)]!;
    const checker = new Checker(store !== 'redlock');
    const kinds = ['run', 'run', 'acquire', 'group', 'read', 'write', ...(store === 'redlock' ? [] : ['fair'])] as const;
    const done: Record<string, number> = {};
    const refused: unknown[] = [];
    let contended = 0;
    const subscriptions = apps.map((app) => app.locks.events$.subscribe((e) => e.type === 'contended' && contended++));

    const inside = async (locks: LockService, handles: LockHandle[], depth: number): Promise<void> => {
      for (const h of handles) checker.enter(h);
      try {
        await new Promise((resolve) => setTimeout(resolve, Math.floor(next() * 3))); // the protected work
        if (depth < 2 && next() < 0.35) await operation(locks, depth + 1);
      } finally {
        for (const h of handles) checker.leave(h);
      }
    };

    const operation = async (locks: LockService, depth = 0): Promise<void> => {
      const kind = pick(kinds);
      const options = { waitMs: 300 }; // nested locks in opposite orders deadlock until one gives up
      if (kind === 'run') {
        await locks.run(pick(PLAIN), (h) => inside(locks, [h], depth), options);
      } else if (kind === 'acquire') {
        const h = await locks.acquire(pick(PLAIN), options);
        try {
          await h.run(() => inside(locks, [h], depth));
        } finally {
          await h.release();
        }
      } else if (kind === 'group') {
        await locks.run([pick(PLAIN), pick(PLAIN), pick(PLAIN)], (g) => inside(locks, [...g.handles], depth), options);
      } else if (kind === 'read' || kind === 'write') {
        const key = pick(READ_WRITE);
        if (kind === 'write' && locks.current(key)?.mode === 'read') return; // a reader may not upgrade (refused, tested elsewhere)
        await locks.run(key, (h) => inside(locks, [h], depth), { ...options, mode: kind });
      } else {
        await locks.run(pick(FAIR), (h) => inside(locks, [h], depth), { ...options, fair: true });
      }
      done[kind] = (done[kind] ?? 0) + 1;
    };

    const worker = async (locks: LockService) => {
      for (let i = 0; i < OPS; i++) {
        // Each top-level operation in a fresh async scope: its own owner, as a request would have.
        await new AsyncResource('operation').runInAsyncScope(() =>
          operation(locks).catch((error: unknown) => {
            if (!(error instanceof LockNotAcquiredError)) refused.push(error);
          }),
        );
      }
    };
    const workers = Array.from({ length: SERVICES * WORKERS }, (_, i) => apps[i % apps.length]!.locks);
    await Promise.all(workers.map(worker));
    for (const s of subscriptions) s.unsubscribe();

    expect(checker.violations).toEqual([]);
    expect(refused).toEqual([]);
    // The run did contend: owners waited for each other, and readers shared their keys.
    expect(contended).toBeGreaterThan(0);
    expect(checker.readersTogether).toBeGreaterThan(0);
    for (const kind of new Set(kinds)) expect(done[kind]).toBeGreaterThan(10);
    // Everything released: no lock, queue or waiting-writers key is left, only fencing counters.
    if (store === 'memory') for (const key of [...PLAIN, ...READ_WRITE, ...FAIR]) expect(await apps[0]!.locks.isLocked(key)).toBe(false);
    else expect(await leftInRedis()).toEqual([]);
  }, 120_000);
});
