import { afterAll, beforeAll, describe, expect, it, jest } from '@jest/globals';
import { performance } from 'node:perf_hooks';
import { MemoryLockStore } from '../../lib/store/memory/memory-lock.store.js';
import { RedisLockStore } from '../../lib/store/redis/redis-lock.store.js';
import type { LockStore, ReleaseWatch } from '../../lib/store/lock-store.js';
import { PENDING, settled } from '../support/lock-testing.js';
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
    await store.abandon(key, 'B', 'exclusive', true, b.waitId);
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
    const newcomer = await store.acquire({ key, owner: 'C', ...fair });
    expect(newcomer.granted).toBe(false);
    // C is told to sleep a while (B's handover lease, or what is left of B's place), not 0 ms.
    expect(!newcomer.granted && newcomer.ttlMs).toBeGreaterThan(0);
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
    // A multi-key group re-entering the key: the same; its fresh key gets the group's lease.
    expect(await store.acquireMany!(['contract:lease', 'contract:lease-new'], 'A', 1_000)).toMatchObject({ granted: true, grants: [{ holdCount: 3 }, { holdCount: 1 }] });
    expect((await store.inspect('contract:lease', 'A')).ttlMs).toBeGreaterThan(19_000);
    expect((await store.inspect('contract:lease-new', 'A')).ttlMs).toBeLessThanOrEqual(1_000);
    await store.acquire({ key: 'contract:read-lease', owner: 'A', leaseMs: 20_000, mode: 'read' });
    expect(await store.acquire({ key: 'contract:read-lease', owner: 'A', leaseMs: 1_000, mode: 'read' })).toMatchObject({ granted: true, holdCount: 2 });
    expect(await store.acquire({ key: 'contract:read-lease', owner: 'B', leaseMs: 1_000, mode: 'read' })).toMatchObject({ granted: true, holdCount: 1 });
    expect((await store.inspect('contract:read-lease', 'B', 'read')).ttlMs).toBeGreaterThan(19_000);
    // A read hold is counted on the read side: A's two, B's one, and no plain hold of A's.
    expect((await store.inspect('contract:read-lease', 'A', 'read')).holdCount).toBe(2);
    expect((await store.inspect('contract:read-lease', 'B', 'read')).holdCount).toBe(1);
    expect((await store.inspect('contract:read-lease', 'A')).holdCount).toBe(0);
    expect(await store.releaseAll('contract:lease', 'A')).toBe(true);
    expect(await store.releaseAll('contract:lease-new', 'A')).toBe(true);
    expect(await store.releaseAll('contract:read-lease', 'A', 'read')).toBe(true);
    expect(await store.releaseAll('contract:read-lease', 'B', 'read')).toBe(true);
  });

  it("never shortens a lock's lease when a holder renews; only a holder alone sets it shorter, and only when asked to (extend())", async () => {
    const ttl = async (key: string) => (await store.inspect(key, undefined)).ttlMs;
    // Two readers: the first renews its short lease, and the second's long one stays.
    const key = 'contract:renew-shared';
    await store.acquire({ key, owner: 'R1', leaseMs: 1_000, mode: 'read' });
    await store.acquire({ key, owner: 'R2', leaseMs: 20_000, mode: 'read' });
    expect(await store.renew([{ key, owner: 'R1', leaseMs: 1_000, mode: 'read' }])).toEqual([true]);
    expect(await ttl(key)).toBeGreaterThan(19_000);
    expect(await store.renew([{ key, owner: 'R1', leaseMs: 1_000, mode: 'read', exact: true }])).toEqual([true]);
    expect(await ttl(key)).toBeGreaterThan(19_000);
    // A renewal that Redis runs after the holder's release changes nothing.
    expect(await store.releaseAll(key, 'R1', 'read')).toBe(true);
    expect(await store.renew([{ key, owner: 'R1', leaseMs: 1_000, mode: 'read' }])).toEqual([false]);
    expect(await ttl(key)).toBeGreaterThan(19_000);
    // The reader left alone may shorten its own lease (extend() to less); a renewal never does.
    expect(await store.renew([{ key, owner: 'R2', leaseMs: 2_000, mode: 'read' }])).toEqual([true]);
    expect(await ttl(key)).toBeGreaterThan(19_000);
    expect(await store.renew([{ key, owner: 'R2', leaseMs: 2_000, mode: 'read', exact: true }])).toEqual([true]);
    expect(await ttl(key)).toBeLessThanOrEqual(2_000);
    expect(await store.releaseAll(key, 'R2', 'read')).toBe(true);
    expect(await store.renew([{ key, owner: 'R2', leaseMs: 2_000, mode: 'read' }])).toEqual([false]);
    expect(await ttl(key)).toBe(-2);

    // One owner's two sides are two holders: a writer that also reads (its read side's short lease),
    // and a plain lock whose owner also reads.
    for (const [side, name] of [['write', 'contract:renew-sides-rw'], ['exclusive', 'contract:renew-sides']] as const) {
      await store.acquire({ key: name, owner: 'W', leaseMs: 20_000, mode: side });
      await store.acquire({ key: name, owner: 'W', leaseMs: 1_000, mode: 'read' });
      expect(await store.renew([{ key: name, owner: 'W', leaseMs: 1_000, mode: 'read', exact: true }])).toEqual([true]);
      expect(await ttl(name)).toBeGreaterThan(19_000);
      // The other way round: the read side (20 s now) outlives a shorter lease of the first side.
      expect(await store.renew([{ key: name, owner: 'W', leaseMs: 20_000, mode: 'read' }, { key: name, owner: 'W', leaseMs: 2_000, mode: side, exact: true }])).toEqual([true, true]);
      expect(await ttl(name)).toBeGreaterThan(19_000);
      expect(await store.releaseAll(name, 'W', side)).toBe(true);
      expect(await store.releaseAll(name, 'W', 'read')).toBe(true);
    }

    // An exclusive lock's holder alone, also one handed over in fair mode, sets it shorter when asked.
    await store.acquire({ key: 'contract:renew-alone', owner: 'A', leaseMs: 20_000 });
    expect(await store.renew([{ key: 'contract:renew-alone', owner: 'A', leaseMs: 2_000 }])).toEqual([true]);
    expect(await ttl('contract:renew-alone')).toBeGreaterThan(19_000);
    expect(await store.renew([{ key: 'contract:renew-alone', owner: 'A', leaseMs: 2_000, exact: true }])).toEqual([true]);
    expect(await ttl('contract:renew-alone')).toBeLessThanOrEqual(2_000);
    expect(await store.releaseAll('contract:renew-alone', 'A')).toBe(true);
    expect(await store.renew([{ key: 'contract:renew-alone', owner: 'A', leaseMs: 2_000 }])).toEqual([false]);
    expect(await ttl('contract:renew-alone')).toBe(-2);
    // An owner counting more holds than the caller says are its own (an owner given by name, which
    // another process holds the lock under too) keeps its lease, however exact the request.
    await store.acquire({ key: 'contract:renew-named', owner: 'N', leaseMs: 20_000 });
    await store.acquire({ key: 'contract:renew-named', owner: 'N', leaseMs: 20_000 });
    expect(await store.renew([{ key: 'contract:renew-named', owner: 'N', leaseMs: 2_000, exact: true, holdsAtMost: 1 }])).toEqual([true]);
    expect(await ttl('contract:renew-named')).toBeGreaterThan(19_000);
    expect(await store.renew([{ key: 'contract:renew-named', owner: 'N', leaseMs: 2_000, exact: true, holdsAtMost: 2 }])).toEqual([true]);
    expect(await ttl('contract:renew-named')).toBeLessThanOrEqual(2_000);
    expect(await store.releaseAll('contract:renew-named', 'N')).toBe(true);
    const handed = 'contract:renew-handed';
    await store.acquire({ key: handed, owner: 'A', ...fair });
    const b = await queue(handed, 'B');
    const woke = b.sleep(10_000);
    expect(await store.release(handed, 'A')).toBe(0);
    expect(await woke).toBe(headWakes);
    b.close();
    if (kind === 'memory') expect((await store.acquire({ key: handed, owner: 'B', ...fair })).granted).toBe(true);
    expect(await store.renew([{ key: handed, owner: 'B', leaseMs: 20_000 }])).toEqual([true]);
    expect(await store.renew([{ key: handed, owner: 'B', leaseMs: 2_000, exact: true }])).toEqual([true]);
    expect(await ttl(handed)).toBeLessThanOrEqual(2_000);
    expect(await store.release(handed, 'B')).toBe(0);
  });

  it('wakes every waiter when a holder alone sets its lease shorter, so that each learns the new one', async () => {
    const key = 'contract:shortened';
    expect((await store.acquire({ key, owner: 'A', leaseMs: 20_000 })).granted).toBe(true);
    // Refused with A's 20 s lease, each would sleep that long unless woken.
    const waiters = [await queue(key, 'B', { leaseMs: 10_000 }), await queue(key, 'C', { leaseMs: 10_000 })];
    const woke = waiters.map((w) => w.sleep(20_000));
    expect(await store.renew([{ key, owner: 'A', leaseMs: 2_000, exact: true }])).toEqual([true]);
    expect(await Promise.all(woke)).toEqual(['released', 'released']);
    const again = await store.acquire({ key, owner: 'B', leaseMs: 10_000 });
    expect(again.granted).toBe(false);
    expect(!again.granted && again.ttlMs).toBeLessThanOrEqual(2_000);
    for (const w of waiters) w.close();
    expect(await store.release(key, 'A')).toBe(0);
  });

  it('takes a multi-key group all or nothing, re-entering the keys its owner holds', async () => {
    const held = await store.acquire({ key: 'contract:m1', owner: 'A', leaseMs: 10_000 });
    if (!held.granted) throw new Error('A was refused');
    const group = await store.acquireMany!(['contract:m1', 'contract:m2'], 'A', 10_000);
    expect(group).toEqual({ granted: true, grants: [{ holdCount: 2, fencingToken: held.fencingToken }, { holdCount: 1, fencingToken: expect.any(Number) }] });
    expect((await store.inspect('contract:m1', 'A')).holdCount).toBe(2);
    const blocked = await store.acquireMany!(['contract:m3', 'contract:m2'], 'B', 10_000);
    expect(blocked).toEqual({ granted: false, blockedBy: 'contract:m2', ttlMs: expect.any(Number) });
    // How long to sleep at most: what is left of the blocking lock's lease (10 s).
    expect(blocked.granted === false && blocked.ttlMs).toBeGreaterThan(9_000);
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
    // Not a bare counter: at least the wall clock in microseconds (give or take a minute between
    // the clocks), so that a counter forgotten or lost still never goes back.
    expect(tokens[0]).toBeGreaterThan((Date.now() - 60_000) * 1_000);
    expect(await Promise.all(releases)).toEqual(releases.map(() => 0));
    const repeated = tokens.filter((t, i) => i > 0 && t <= tokens[i - 1]!);
    expect(repeated).toEqual([]);
  });

  it('wakes one waiter, the longest-waiting, when an exclusive lock is freed: not all of them', async () => {
    const key = 'contract:wake-one';
    expect((await store.acquire({ key, owner: 'A', leaseMs: 10_000 })).granted).toBe(true);
    const waiters = [await queue(key, 'B', {}), await queue(key, 'C', {})];
    const [first, second] = waiters.map((w) => w.sleep(10_000));
    expect(await store.release(key, 'A')).toBe(0);
    expect(await first).toBe('released');
    // A notice wakes its waiters at once: had it woken C too, C's sleep would have ended by now.
    expect(await settled(second!)).toBe(PENDING);
    for (const w of waiters) w.close();
  });

  it('gives back nothing for an owner that holds nothing, on a lock held by another or on a free key', async () => {
    const key = 'contract:holds-nothing';
    expect((await store.acquire({ key, owner: 'A', leaseMs: 10_000 })).granted).toBe(true);
    expect(await store.releaseAll(key, 'B')).toBe(false);
    expect(await store.release(key, 'B')).toBe(-1);
    expect(await store.inspect(key, 'A')).toMatchObject({ locked: true, holdCount: 1 });
    expect(await store.release(key, 'A')).toBe(0);
    expect(await store.releaseAll(key, 'A')).toBe(false);
    expect((await store.inspect(key, undefined)).locked).toBe(false);
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

  it('lets a writer that holds the write lock take its read side while another writer waits', async () => {
    const key = 'contract:rw-own-read';
    expect((await store.acquire({ key, owner: 'W', leaseMs: 10_000, mode: 'write' })).granted).toBe(true);
    expect((await store.acquire({ key, owner: 'X', leaseMs: 10_000, mode: 'write', queueTimeoutMs: 5_000 })).granted).toBe(false);
    // X waits for the write lock; W reading its own lock is not one of the readers X goes before.
    expect(await store.acquire({ key, owner: 'W', leaseMs: 10_000, mode: 'read' })).toMatchObject({ granted: true, holdCount: 1 });
    expect((await store.acquire({ key, owner: 'R', leaseMs: 10_000, mode: 'read' })).granted).toBe(false);
    expect(await store.releaseAll(key, 'W', 'read')).toBe(true);
    expect(await store.releaseAll(key, 'W', 'write')).toBe(true);
    await store.abandon(key, 'X', 'write', false);
  });

  it('tells a reader kept out only by a waiting writer (the lock free) how long that writer keeps its place', async () => {
    const key = 'contract:rw-writer-place';
    expect((await store.acquire({ key, owner: 'R1', leaseMs: 10_000, mode: 'read' })).granted).toBe(true);
    expect((await store.acquire({ key, owner: 'X', leaseMs: 10_000, mode: 'write', queueTimeoutMs: 5_000 })).granted).toBe(false);
    expect(await store.release(key, 'R1', 'read')).toBe(0);
    // Free, but X has not come back yet: R2 stays out, for up to what is left of X's place (5 s).
    const r2 = await store.acquire({ key, owner: 'R2', leaseMs: 10_000, mode: 'read' });
    expect(r2.granted).toBe(false);
    expect(!r2.granted && r2.ttlMs).toBeGreaterThan(4_000);
    expect(!r2.granted && r2.ttlMs).toBeLessThanOrEqual(5_000);
    // When X gives up, R2 is woken: it need not sleep out what was left of X's place.
    const watch = store.watch(key, 'R2');
    await watch.ready;
    const woke = watch.sleep(10_000);
    await store.abandon(key, 'X', 'write', false);
    expect(await woke).toBe('released');
    watch.close();
  });

  it('lets readers in at once when a waiting writer gives up (abandon), without waiting for its place to lapse', async () => {
    const key = 'contract:rw-writer-gone';
    expect((await store.acquire({ key, owner: 'R1', leaseMs: 10_000, mode: 'read' })).granted).toBe(true);
    expect((await store.acquire({ key, owner: 'X', leaseMs: 10_000, mode: 'write', queueTimeoutMs: 60_000 })).granted).toBe(false);
    expect((await store.acquire({ key, owner: 'R2', leaseMs: 10_000, mode: 'read' })).granted).toBe(false);
    await store.abandon(key, 'X', 'write', false);
    expect((await store.acquire({ key, owner: 'R2', leaseMs: 10_000, mode: 'read' })).granted).toBe(true);
    for (const owner of ['R1', 'R2']) expect(await store.releaseAll(key, owner, 'read')).toBe(true);
  });

  it('wakes the readers a waiting writer kept out when it gives up: they need not sleep until the read lock\'s lease ends', async () => {
    const key = 'contract:rw-writer-leaves';
    expect((await store.acquire({ key, owner: 'R1', leaseMs: 10_000, mode: 'read' })).granted).toBe(true);
    expect((await store.acquire({ key, owner: 'X', leaseMs: 10_000, mode: 'write', queueTimeoutMs: 60_000 })).granted).toBe(false);
    const reader = await queue(key, 'R2', { mode: 'read' });
    const woke = reader.sleep(10_000);
    await store.abandon(key, 'X', 'write', false);
    expect(await woke).toBe('released');
    reader.close();
    expect((await store.acquire({ key, owner: 'R2', leaseMs: 10_000, mode: 'read' })).granted).toBe(true);
    for (const owner of ['R1', 'R2']) expect(await store.releaseAll(key, owner, 'read')).toBe(true);
  });

  /**
   * For `ms` (past the place's 1 s timeout), every 100 ms: `probe` (another owner, who must not get
   * ahead of the waiter at any moment), then the waiter's own attempt, refused: it keeps coming back.
   */
  const keepAttempting = async (ms: number, probe: () => Promise<{ granted: boolean }>, attempt: () => Promise<{ granted: boolean }>) => {
    const end = performance.now() + ms;
    expect((await attempt()).granted).toBe(false);
    while (performance.now() < end) {
      await new Promise((resolve) => setTimeout(resolve, 100));
      expect((await probe()).granted).toBe(false);
      expect((await attempt()).granted).toBe(false);
    }
  };
  // 1 s: ten attempts per timeout, so that a loaded machine's stall between two does not lose the place.
  const place = { leaseMs: 10_000, queueTimeoutMs: 1_000 } as const;

  it("keeps a waiting writer's place, and a fair waiter's, for as long as it attempts again within the queue timeout", async () => {
    const key = 'contract:places-kept';
    expect((await store.acquire({ key, owner: 'R1', leaseMs: 10_000, mode: 'read' })).granted).toBe(true);
    // Throughout 2.5 timeouts, X's place keeps a new reader out.
    await keepAttempting(
      2_500,
      () => store.acquire({ key, owner: 'R2', leaseMs: 10_000, mode: 'read' }),
      () => store.acquire({ key, owner: 'X', ...place, mode: 'write' }),
    );
    expect(await store.release(key, 'R1', 'read')).toBe(0);
    expect((await store.acquire({ key, owner: 'X', ...place, mode: 'write' })).granted).toBe(true);
    expect(await store.release(key, 'X', 'write')).toBe(0);

    const fairKey = 'contract:fair-place-kept';
    expect((await store.acquire({ key: fairKey, owner: 'A', ...fair })).granted).toBe(true);
    // Throughout 2.5 timeouts, B stays ahead of C, who queues meanwhile.
    await keepAttempting(
      2_500,
      () => store.acquire({ key: fairKey, owner: 'C', ...fair }),
      () => store.acquire({ key: fairKey, owner: 'B', ...fair, ...place }),
    );
    expect(await store.release(fairKey, 'A')).toBe(0);
    // B is still the head of the queue: the lock is B's (handed over, or waiting for it), not C's.
    expect((await store.acquire({ key: fairKey, owner: 'C', ...fair })).granted).toBe(false);
    expect(await store.acquire({ key: fairKey, owner: 'B', ...fair })).toMatchObject({ granted: true, holdCount: 1 });
    expect(await store.release(fairKey, 'B')).toBe(0);
    expect(await store.acquire({ key: fairKey, owner: 'C', ...fair })).toMatchObject({ granted: true, holdCount: 1 });
    expect(await store.release(fairKey, 'C')).toBe(0);
  });

  it("drops a writer's place, and a fair waiter's, once it has not attempted for the queue timeout (its process gone)", async () => {
    const key = 'contract:places-lapsed';
    expect((await store.acquire({ key, owner: 'R1', leaseMs: 10_000, mode: 'read' })).granted).toBe(true);
    expect((await store.acquire({ key, owner: 'X', ...place, mode: 'write' })).granted).toBe(false);
    const fairKey = 'contract:fair-place-lapsed';
    expect((await store.acquire({ key: fairKey, owner: 'A', ...fair })).granted).toBe(true);
    expect((await store.acquire({ key: fairKey, owner: 'B', ...fair, ...place })).granted).toBe(false);
    // X and B never come back: after their 1 s, readers get in and the fair lock goes to the next comer.
    await until(async () => (await store.acquire({ key, owner: 'R2', leaseMs: 10_000, mode: 'read' })).granted, 5_000, "X's place lapsed");
    for (const owner of ['R1', 'R2']) expect(await store.releaseAll(key, owner, 'read')).toBe(true);
    // A leaves: the lock goes to C once B's place (or, on Redis, the short lease it was handed the
    // lock with, if its place was still there) has run out with B never back.
    expect(await store.release(fairKey, 'A')).toBe(0);
    await until(async () => (await store.acquire({ key: fairKey, owner: 'C', ...fair })).granted, 5_000, "B's place lapsed");
    expect(await store.release(fairKey, 'C')).toBe(0);
  });
});
