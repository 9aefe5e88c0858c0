import { afterAll, beforeAll, describe, expect, it, jest } from '@jest/globals';
import { performance } from 'node:perf_hooks';
import { MemoryLockStore } from '../../lib/store/memory/memory-lock.store.js';
import { RedisLockStore } from '../../lib/store/redis/redis-lock.store.js';
import type { LockStore, ReleaseWatch } from '../../lib/store/lock-store.js';
import { RedisServer, until } from '../support/redis-server.js';

const quiet = { debug: () => undefined, warn: () => undefined };

/**
 * The store steps themselves, the same sequence on the Redis store (its scripts) and on the memory
 * store, which claims the same semantics: what the public API cannot reach on demand (a fair lock
 * free with waiters queued, the head of the queue giving up, a take-back of every hold of a writer,
 * grants in a row with the clock stopped). Where the two wake a waiter differently on purpose
 * (Redis hands a fair lock over inside the release, the memory store wakes the head to take it),
 * the test names both.
 */
describe.each(['redis', 'memory'] as const)('store steps on the %s store', (kind) => {
  let redis: RedisServer | undefined;
  let store: LockStore;
  const fair = { fair: true, leaseMs: 10_000, queueTimeoutMs: 5_000 } as const;
  /** How a fair waiter's sleep ends when the lock is freed with it at the head of the queue. */
  const headWakes = kind === 'redis' ? 'granted' : 'released';

  beforeAll(async () => {
    if (kind === 'redis') {
      redis = await RedisServer.start();
      store = new RedisLockStore(redis.client(), false, 'lock:', quiet);
    } else {
      store = new MemoryLockStore();
    }
    await store.ready(5_000);
  });
  afterAll(async () => {
    await store?.close();
    await redis?.stop();
  });

  /** Watches `key` for `owner` (ready), then attempts: the attempt must be refused. */
  const queue = async (key: string, owner: string, request: Partial<Parameters<LockStore['acquire']>[0]> = fair): Promise<ReleaseWatch> => {
    const watch = store.watch(key, owner);
    await watch.ready;
    const refused = await store.acquire({ key, owner, leaseMs: 10_000, ...request, waitId: watch.waitId });
    expect(refused.granted).toBe(false);
    watch.forgetGrant(refused.granted ? undefined : refused.lastToken);
    return watch;
  };

  it('gives a fair lock freed with waiters queued to the head of the queue, never to a newcomer', async () => {
    const key = 'contract:fair-free';
    expect((await store.acquire({ key, owner: 'A', ...fair })).granted).toBe(true);
    expect((await store.acquire({ key, owner: 'B', ...fair })).granted).toBe(false);
    expect(await store.forceUnlock(key)).toBe(true);
    // Free (memory) or handed to B (Redis): either way not C's, who came after B.
    expect((await store.acquire({ key, owner: 'C', ...fair })).granted).toBe(false);
    expect(await store.acquire({ key, owner: 'B', ...fair })).toEqual({ granted: true, holdCount: 1, fencingToken: expect.any(Number) });
    expect((await store.acquire({ key, owner: 'C', ...fair })).granted).toBe(false);
    expect(await store.release(key, 'B')).toBe(0);
    expect(await store.acquire({ key, owner: 'C', ...fair })).toMatchObject({ granted: true, holdCount: 1 });
    expect(await store.release(key, 'C')).toBe(0);
    expect((await store.inspect(key, undefined)).locked).toBe(false);
  });

  it('wakes the head of a fair queue by name when the lock is freed, and the next head when that one gives up', async () => {
    const key = 'contract:fair-wake';
    expect((await store.acquire({ key, owner: 'A', ...fair })).granted).toBe(true);
    // C watches first, so a store waking "one waiter" instead of the head would wake C.
    const c = store.watch(key, 'C');
    const b = await queue(key, 'B');
    await c.ready;
    const refused = await store.acquire({ key, owner: 'C', ...fair, waitId: c.waitId });
    c.forgetGrant(refused.granted ? undefined : refused.lastToken);
    const cWoke = c.sleep(10_000);
    const bWoke = b.sleep(10_000);
    expect(await store.release(key, 'A')).toBe(0);
    expect(await bWoke).toBe(headWakes);
    // B gives up without taking the lock: it goes to C, who is woken.
    b.close();
    await store.abandon(key, 'B', 'exclusive', true);
    expect(await cWoke).toBe(headWakes);
    expect(await store.acquire({ key, owner: 'C', ...fair, waitId: c.waitId })).toMatchObject({ granted: true, holdCount: 1 });
    c.close();
    expect(await store.release(key, 'C')).toBe(0);
  });

  it('gives a fair lock whose lease ran out to the head of the queue when a newcomer attempts, and refuses the newcomer', async () => {
    const key = 'contract:fair-lapsed';
    expect((await store.acquire({ key, owner: 'A', ...fair, leaseMs: 200 })).granted).toBe(true);
    const b = await queue(key, 'B');
    const bWoke = b.sleep(10_000);
    // A's lease runs out with nothing to announce it (as when A's process crashed).
    await until(async () => !(await store.inspect(key, undefined)).locked, 5_000, "A's lease run out");
    expect((await store.acquire({ key, owner: 'C', ...fair })).granted).toBe(false);
    expect(await bWoke).toBe(headWakes);
    expect(await store.acquire({ key, owner: 'B', ...fair, waitId: b.waitId })).toMatchObject({ granted: true, holdCount: 1 });
    b.close();
    expect(await store.release(key, 'B')).toBe(0);
    await store.abandon(key, 'C', 'exclusive', true);
  });

  it('never shortens a lease on re-entry, or when another reader joins a read lock', async () => {
    await store.acquire({ key: 'contract:lease', owner: 'A', leaseMs: 20_000 });
    expect(await store.acquire({ key: 'contract:lease', owner: 'A', leaseMs: 1_000 })).toMatchObject({ granted: true, holdCount: 2 });
    expect((await store.inspect('contract:lease', 'A')).ttlMs).toBeGreaterThan(19_000);
    await store.acquire({ key: 'contract:read-lease', owner: 'A', leaseMs: 20_000, mode: 'read' });
    expect(await store.acquire({ key: 'contract:read-lease', owner: 'A', leaseMs: 1_000, mode: 'read' })).toMatchObject({ granted: true, holdCount: 2 });
    expect(await store.acquire({ key: 'contract:read-lease', owner: 'B', leaseMs: 1_000, mode: 'read' })).toMatchObject({ granted: true, holdCount: 1 });
    expect((await store.inspect('contract:read-lease', 'B', 'read')).ttlMs).toBeGreaterThan(19_000);
    expect(await store.releaseAll('contract:lease', 'A')).toBe(true);
    expect(await store.releaseAll('contract:read-lease', 'A', 'read')).toBe(true);
    expect(await store.releaseAll('contract:read-lease', 'B', 'read')).toBe(true);
  });

  it('takes a multi-key group all or nothing, re-entering the keys its owner holds', async () => {
    const held = await store.acquire({ key: 'contract:m1', owner: 'A', leaseMs: 10_000 });
    if (!held.granted) throw new Error('A was refused');
    const group = await store.acquireMany!(['contract:m1', 'contract:m2'], 'A', 10_000);
    expect(group).toEqual({ granted: true, grants: [{ holdCount: 2, fencingToken: held.fencingToken }, { holdCount: 1, fencingToken: expect.any(Number) }] });
    expect((await store.inspect('contract:m1', 'A')).holdCount).toBe(2);
    expect(await store.acquireMany!(['contract:m3', 'contract:m2'], 'B', 10_000)).toEqual({ granted: false, blockedBy: 'contract:m2', ttlMs: expect.any(Number) });
    expect((await store.inspect('contract:m3', undefined)).locked).toBe(false);
    for (const key of ['contract:m1', 'contract:m2']) expect(await store.releaseAll(key, 'A')).toBe(true);
  });

  it('issues strictly increasing fencing tokens to grants in a row, even where the clock has not moved on', async () => {
    // A token is max(last + 1, the clock in microseconds). The memory store's clock is this
    // process's, stopped here (Redis's TIME cannot be); the Redis store's grants go back to back.
    const stopped = kind === 'memory' ? jest.spyOn(performance, 'now').mockReturnValue(performance.now()) : undefined;
    const grants: Promise<unknown>[] = [];
    const releases: Promise<number>[] = [];
    try {
      // Sent without waiting: the memory store runs each step at the call, Redis in the order sent.
      for (let i = 0; i < 500; i++) {
        grants.push(store.acquire({ key: 'contract:tokens', owner: 'A', leaseMs: 10_000 }));
        releases.push(store.release('contract:tokens', 'A'));
      }
    } finally {
      stopped?.mockRestore();
    }
    const tokens = (await Promise.all(grants)).map((g) => (g as { fencingToken: number }).fencingToken);
    expect(await Promise.all(releases)).toEqual(releases.map(() => 0));
    const repeated = tokens.filter((t, i) => i > 0 && t <= tokens[i - 1]!);
    expect(repeated).toEqual([]);
  });

  it('wakes every waiting reader when a writer\'s holds are all taken back at once', async () => {
    const key = 'contract:rw-all';
    expect((await store.acquire({ key, owner: 'W', leaseMs: 10_000, mode: 'write' })).granted).toBe(true);
    const readers = [await queue(key, 'R1', { mode: 'read' }), await queue(key, 'R2', { mode: 'read' })];
    const woke = readers.map((r) => r.sleep(10_000));
    expect(await store.releaseAll(key, 'W', 'write')).toBe(true);
    expect(await Promise.all(woke)).toEqual(['released', 'released']);
    for (const r of readers) r.close();
    for (const owner of ['R1', 'R2']) expect((await store.acquire({ key, owner, leaseMs: 10_000, mode: 'read' })).granted).toBe(true);
    for (const owner of ['R1', 'R2']) expect(await store.releaseAll(key, owner, 'read')).toBe(true);
    expect((await store.inspect(key, undefined)).locked).toBe(false);
  });

  it('wakes every waiter when a lock is force-unlocked: it may be a write lock with readers waiting', async () => {
    const key = 'contract:force';
    expect((await store.acquire({ key, owner: 'W', leaseMs: 10_000, mode: 'write' })).granted).toBe(true);
    const readers = [await queue(key, 'R1', { mode: 'read' }), await queue(key, 'R2', { mode: 'read' })];
    const woke = readers.map((r) => r.sleep(10_000));
    expect(await store.forceUnlock(key)).toBe(true);
    expect(await Promise.all(woke)).toEqual(['released', 'released']);
    for (const r of readers) r.close();
  });

  it('keeps a plain exclusive lock exclusive while its owner keeps a read hold: unlike a write lock, it is not turned into a read lock', async () => {
    const key = 'contract:plain-read';
    expect((await store.acquire({ key, owner: 'P', leaseMs: 10_000 })).granted).toBe(true);
    expect((await store.acquire({ key, owner: 'P', leaseMs: 10_000, mode: 'read' })).granted).toBe(true);
    expect(await store.release(key, 'P')).toBe(0);
    // The owner's read hold still excludes everyone else, readers included.
    expect((await store.acquire({ key, owner: 'R', leaseMs: 10_000, mode: 'read' })).granted).toBe(false);
    expect((await store.acquire({ key, owner: 'X', leaseMs: 10_000 })).granted).toBe(false);
    expect(await store.release(key, 'P', 'read')).toBe(0);
    expect((await store.acquire({ key, owner: 'R', leaseMs: 10_000, mode: 'read' })).granted).toBe(true);
    expect(await store.releaseAll(key, 'R', 'read')).toBe(true);
    expect((await store.inspect(key, undefined)).locked).toBe(false);
  });

  it('turns a write lock whose writer keeps only read holds into a read lock when its write holds are all taken back, waking the readers', async () => {
    const key = 'contract:rw-downgrade';
    expect((await store.acquire({ key, owner: 'W', leaseMs: 10_000, mode: 'write' })).granted).toBe(true);
    expect((await store.acquire({ key, owner: 'W', leaseMs: 10_000, mode: 'read' })).granted).toBe(true);
    const reader = await queue(key, 'R', { mode: 'read' });
    const woke = reader.sleep(10_000);
    expect(await store.releaseAll(key, 'W', 'write')).toBe(true);
    expect(await woke).toBe('released');
    reader.close();
    expect((await store.acquire({ key, owner: 'R', leaseMs: 10_000, mode: 'read' })).granted).toBe(true);
    expect((await store.acquire({ key, owner: 'X', leaseMs: 10_000, mode: 'write' })).granted).toBe(false);
    expect(await store.releaseAll(key, 'R', 'read')).toBe(true);
    expect(await store.releaseAll(key, 'W', 'read')).toBe(true);
    expect((await store.inspect(key, undefined)).locked).toBe(false);
  });
});
