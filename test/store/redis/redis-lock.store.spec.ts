import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import type { Redis } from 'ioredis';
import { RedisLockStore } from '../../../lib/store/redis/redis-lock.store.js';
import { ADJUST_HOLDS, FENCE_COUNTER_TTL_MS } from '../../../lib/store/redis/lock.scripts.js';
import { RedisServer } from '../../support/redis-server.js';

const quiet = { debug: () => undefined, warn: () => undefined };

describe('RedisLockStore scripts', () => {
  let redis: RedisServer;
  let raw: Redis;
  let client: Redis;
  let store: RedisLockStore;
  /** As LockService builds it with `fencingTokens: false`. */
  let noTokens: RedisLockStore;
  beforeAll(async () => {
    redis = await RedisServer.start();
    raw = redis.client();
    client = redis.client();
    store = new RedisLockStore(client, false, 'lock:', quiet);
    noTokens = new RedisLockStore(client, false, 'lock:', quiet, undefined, FENCE_COUNTER_TTL_MS, false);
    await Promise.all([store.ready(5_000), noTokens.ready(5_000)]);
  });
  afterAll(async () => {
    await noTokens?.close();
    await store?.close();
    await redis?.stop();
  });

  const snapshot = async (name: string) => ({ hash: await raw.hgetall(name), ttl: await raw.pttl(name) });
  /** The options of the fair acquisitions below. */
  const fair = { fair: true, leaseMs: 10_000, queueTimeoutMs: 5_000 };

  it('stores one hash per lock: owner -> hold count, with the lease as PEXPIRE', async () => {
    const a = await store.acquire({ key: 'model', owner: 'A', leaseMs: 10_000 });
    expect(a).toEqual({ granted: true, holdCount: 1, fencingToken: expect.any(Number) });
    const b = await store.acquire({ key: 'model', owner: 'A', leaseMs: 10_000 });
    expect(b).toEqual({ granted: true, holdCount: 2, fencingToken: (a as { fencingToken: number }).fencingToken });
    expect(await raw.hgetall('lock:{model}')).toEqual({ A: '2' });
    expect(await raw.pttl('lock:{model}')).toBeGreaterThan(9_000);
    const c = await store.acquire({ key: 'model', owner: 'B', leaseMs: 10_000 });
    expect(c.granted).toBe(false);
    expect((c as { ttlMs: number }).ttlMs).toBeGreaterThan(9_000);
    expect(await store.release('model', 'A')).toBe(1);
    expect(await store.release('model', 'A')).toBe(0);
    expect(await raw.exists('lock:{model}')).toBe(0);
  });

  it('never lets a non-owner release, renew or shorten a lock', async () => {
    await store.acquire({ key: 'owned', owner: 'A', leaseMs: 10_000 });
    await store.acquire({ key: 'owned', owner: 'A', leaseMs: 10_000 });
    const before = await snapshot('lock:{owned}');
    expect(await store.release('owned', 'B')).toBe(-1);
    expect(await store.releaseAll('owned', 'B')).toBe(false);
    expect(await store.renew([{ key: 'owned', owner: 'B', leaseMs: 100 }])).toEqual([false]);
    const after = await snapshot('lock:{owned}');
    expect(after.hash).toEqual(before.hash);
    expect(after.ttl).toBeGreaterThan(before.ttl - 1_000);
    expect(after.ttl).toBeLessThanOrEqual(before.ttl);
    expect(await store.releaseAll('owned', 'A')).toBe(true);
    expect(await raw.exists('lock:{owned}')).toBe(0);
  });

  it('renews many keys in one call and reports the ones no longer held', async () => {
    await store.acquire({ key: 'r1', owner: 'A', leaseMs: 1_000 });
    await store.acquire({ key: 'r2', owner: 'B', leaseMs: 1_000 });
    expect(await store.renew([
      { key: 'r1', owner: 'A', leaseMs: 20_000 },
      { key: 'r2', owner: 'A', leaseMs: 20_000 },
      { key: 'missing', owner: 'A', leaseMs: 20_000 },
    ])).toEqual([true, false, false]);
    expect(await raw.pttl('lock:{r1}')).toBeGreaterThan(19_000);
    expect(await raw.pttl('lock:{r2}')).toBeLessThanOrEqual(1_000);
  });

  it('never shortens the lease on re-entry', async () => {
    await store.acquire({ key: 'long', owner: 'A', leaseMs: 20_000 });
    await store.acquire({ key: 'long', owner: 'A', leaseMs: 1_000 });
    expect(await raw.pttl('lock:{long}')).toBeGreaterThan(19_000);
  });

  it.each([
    ['', 'stale-grant', () => store],
    [' (fencingTokens: false: fair locks keep their tokens for this)', 'stale-grant:no-tokens', () => noTokens],
  ])("ignores a fair handover's message that is read after a refused attempt saw a later token (a waiter resumed from a pause)%s", async (_, key, storeOf) => {
    const store = storeOf();
    const holder = await store.acquire({ key, owner: 'H', ...fair });
    if (!holder.granted) throw new Error('the holder was refused');
    const watch = store.watch(key, 'W');
    try {
      await watch.ready;
      const refused = await store.acquire({ key, owner: 'W', ...fair, waitId: watch.waitId });
      expect(refused).toMatchObject({ granted: false, lastToken: holder.fencingToken });
      watch.forgetGrant(refused.granted ? undefined : refused.lastToken);
      // Asleep when a handover's message issued before the refused attempt ran arrives (its token
      // is not past what the attempt saw: void), then a release's: the release is what wakes it.
      expect(holder.fencingToken).toBeGreaterThan(0);
      const woke = watch.sleep(10_000);
      await raw.publish(`lock:{${key}}`, `granted ${holder.fencingToken} ${watch.waitId} W`);
      await raw.publish(`lock:{${key}}`, 'released');
      expect(await woke).toBe('released');
      // Asleep again when that void message and then a later handover's arrive, in order: the later one wakes it.
      const wokeAgain = watch.sleep(10_000);
      await raw.publish(`lock:{${key}}`, `granted ${holder.fencingToken} ${watch.waitId} W`);
      await raw.publish(`lock:{${key}}`, `granted ${holder.fencingToken + 1} ${watch.waitId} W`);
      expect(await wokeAgain).toBe('granted');
      expect(watch.grantedToken).toBe(holder.fencingToken + 1);
    } finally {
      watch.close();
      await store.abandon(key, 'W', 'exclusive', true);
      await store.release(key, 'H');
    }
  });

  it('gives back the hold a fair release handed to a waiter that then left the queue, not the one another acquisition of its owner took meanwhile', async () => {
    const key = 'handed-leave';
    const name = `lock:{${key}}`;
    expect((await store.acquire({ key, owner: 'H', ...fair })).granted).toBe(true);
    const watch = store.watch(key, 'W');
    try {
      await watch.ready;
      expect((await store.acquire({ key, owner: 'W', ...fair, waitId: watch.waitId })).granted).toBe(false);
      expect((await store.acquire({ key, owner: 'N', ...fair })).granted).toBe(false);
      expect(await store.release(key, 'H')).toBe(0);
      expect(await raw.hgetall(name)).toEqual({ W: '1', ':handed': `${watch.waitId} W` });
      // Another task of owner W (an explicit owner shared by two tasks) acquires meanwhile: a hold of its own.
      expect(await store.acquire({ key, owner: 'W', ...fair })).toMatchObject({ granted: true, holdCount: 2 });
      expect(await raw.hgetall(name)).toEqual({ W: '2', ':handed': `${watch.waitId} W` });
    } finally {
      watch.close();
    }
    // The wait gives up without having taken its grant: the hold the handover gave goes, the task's stays.
    await store.abandon(key, 'W', 'exclusive', true, watch.waitId);
    expect(await raw.hgetall(name)).toEqual({ W: '1' });
    await store.abandon(key, 'W', 'exclusive', true, watch.waitId);
    expect(await raw.hgetall(name)).toEqual({ W: '1' });
    // The task's release hands it to N's place, which no wait id names (registered without watching the key).
    expect(await store.release(key, 'W')).toBe(0);
    expect(await raw.hgetall(name)).toEqual({ N: '1', ':handed': ' N' });
    // Nothing took it for N: leaving gives it back, and nobody is left.
    await store.abandon(key, 'N', 'exclusive', true);
    expect(await raw.exists(name, `${name}:queue`)).toBe(0);
  });

  // A wait's first attempt registers its place before the wait watches the channel, so no wait id
  // names it and no message can reach the wait: its next attempt, with its wait id, takes the grant.
  it('gives a fair lock handed to a place registered without a wait id to the owner\'s next attempt as its grant, not as a re-entry', async () => {
    const key = 'handed-no-wait-id';
    const name = `lock:{${key}}`;
    expect((await store.acquire({ key, owner: 'H', ...fair })).granted).toBe(true);
    expect((await store.acquire({ key, owner: 'W', ...fair })).granted).toBe(false);
    expect(await store.release(key, 'H')).toBe(0);
    expect(await raw.hgetall(name)).toEqual({ W: '1', ':handed': ' W' });
    expect(await store.acquire({ key, owner: 'W', ...fair, waitId: 'w.1' })).toMatchObject({ granted: true, holdCount: 1 });
    expect(await raw.hgetall(name)).toEqual({ W: '1' });
    expect(await store.release(key, 'W')).toBe(0);
    expect(await raw.exists(name)).toBe(0);
  });

  it('inspects and force-unlocks, announcing the release to every waiter', async () => {
    expect(await store.inspect('inspect', 'A')).toEqual({ locked: false, holdCount: 0, ttlMs: -2 });
    await store.acquire({ key: 'inspect', owner: 'A', leaseMs: 5_000 });
    const state = await store.inspect('inspect', 'A');
    expect(state).toEqual({ locked: true, holdCount: 1, ttlMs: expect.any(Number) });
    expect(await store.inspect('inspect', 'B')).toMatchObject({ locked: true, holdCount: 0 });
    const sub = redis.client();
    const message = new Promise<string>((resolve) => sub.on('message', (_c: string, m: string) => resolve(m)));
    await sub.subscribe('lock:{inspect}');
    expect(await store.forceUnlock('inspect')).toBe(true);
    expect(await message).toBe('all'); // it may have been a write lock with readers waiting
    expect(await store.forceUnlock('inspect')).toBe(false);
  });

  it('issues fencing tokens that grow across release, expiry and the counter\'s own loss', async () => {
    const tokens: number[] = [];
    const grant = async () => {
      const r = await store.acquire({ key: 'fence', owner: 'A', leaseMs: 1_000 });
      if (!r.granted) throw new Error('not granted');
      tokens.push(r.fencingToken);
    };
    await grant();
    await store.release('fence', 'A');
    await grant();
    await raw.del('lock:{fence}'); // as if the lease expired
    await grant();
    await store.release('fence', 'A');
    await raw.del('lock:{fence}:fence'); // the counter expired or was lost
    await grant();
    await store.release('fence', 'A');
    for (let i = 1; i < tokens.length; i++) expect(tokens[i]).toBeGreaterThan(tokens[i - 1]!);
    expect(Number.isSafeInteger(tokens.at(-1))).toBe(true);
    expect(await raw.pttl('lock:{fence}:fence')).toBeGreaterThan(3_500_000);
  });

  it('trims an owner\'s holds (trimHolds) only from the count it names, never to 0, and not while a step of that holder is in flight', async () => {
    for (let i = 0; i < 3; i++) await store.acquire({ key: 'trim', owner: 'A', leaseMs: 10_000 });
    expect(await store.trimHolds('trim', 'A', 'exclusive', 2, 1)).toBe(false); // Redis counts 3
    expect(await store.trimHolds('trim', 'A', 'exclusive', 3, 0)).toBe(false); // never frees
    expect(await raw.hgetall('lock:{trim}')).toEqual({ A: '3' });
    // Nor does the script, asked directly to take every hold: -2, nothing changed.
    expect(await raw.eval(ADJUST_HOLDS, 1, 'lock:{trim}', 'A', -3, 3)).toBe(-2);
    expect(await raw.hgetall('lock:{trim}')).toEqual({ A: '3' });
    // A re-entry in flight that Redis answers NOSCRIPT runs again behind anything sent meanwhile:
    // a trim sent then would run before it, from the count it names, and leave a hold too few.
    await raw.script('FLUSH');
    await raw.script('LOAD', ADJUST_HOLDS);
    const reentry = store.acquire({ key: 'trim', owner: 'A', leaseMs: 10_000 });
    expect(await store.trimHolds('trim', 'A', 'exclusive', 3, 1)).toBe(false);
    expect(await reentry).toMatchObject({ granted: true, holdCount: 4 });
    expect(await store.trimHolds('trim', 'A', 'exclusive', 4, 1)).toBe(true);
    expect(await raw.hgetall('lock:{trim}')).toEqual({ A: '1' });
    expect(await store.release('trim', 'A')).toBe(0);
    expect(await raw.exists('lock:{trim}')).toBe(0);
  });

  it('keeps working after the server forgot its scripts', async () => {
    await raw.script('FLUSH');
    const r = await store.acquire({ key: 'noscript', owner: 'A', leaseMs: 1_000 });
    expect(r.granted).toBe(true);
    await store.release('noscript', 'A');
  });
});
