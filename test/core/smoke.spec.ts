import { describe, expect, it } from '@jest/globals';
import { expectedServer, serverIdentity, type RedisServer } from '../support/redis-server.js';
import { usePrivateLockApp, type LockApp } from '../support/lock-testing.js';

describe('smoke', () => {
  let redis: RedisServer;
  let app: LockApp;
  usePrivateLockApp({}, (started) => ({ redis, app } = started));

  it('runs on the server this run names: LOCK_TEST_SERVER (Redis 8, Valkey 8 runs), else the redis-server on the PATH', async () => {
    // The servers a test starts are `redis-server` from the PATH; scripts/test.mjs puts another
    // server's wrappers first on it for the runs on Redis 8 and Valkey 8.
    expect(await serverIdentity(redis.shared())).toBe(expectedServer());
  });

  it('acquires and releases', async () => {
    const h = await app.locks.acquire('a');
    expect(h.mode).toBe('exclusive');
    expect(await app.locks.isLocked('a')).toBe(true);
    await h.release();
    expect(await app.locks.isLocked('a')).toBe(false);
  });

  it('reads a lock from outside: isLocked and remainingTtl (null when free, Infinity for a lock key without expiry)', async () => {
    expect([await app.locks.isLocked('read:free'), await app.locks.remainingTtl('read:free')]).toEqual([false, null]);
    const lock = await app.locks.acquire('read:held', { leaseMs: 20_000 });
    expect(await app.locks.remainingTtl('read:held')).toBeGreaterThan(19_000);
    expect(await app.locks.remainingTtl('read:held')).toBeLessThanOrEqual(20_000);
    await lock.release();
    // Written by other code without an expiry (nestjs-locked always sets one).
    await redis.shared().hset('lock:{read:no-expiry}', 'someone', '1');
    try {
      expect(await app.locks.remainingTtl('read:no-expiry')).toBe(Infinity);
    } finally {
      await redis.shared().del('lock:{read:no-expiry}');
    }
  });

  it("counts the named owner's holds with holdCount({ owner }), also inside a lock of another owner, and one side of a read-write lock with { mode }", async () => {
    const a = await app.locks.acquire('count:1', { owner: 'job-1' });
    const b = await app.locks.acquire('count:1', { owner: 'job-1' });
    await app.locks.run('count:2', async () => {
      expect(await app.locks.holdCount('count:1', { owner: 'job-1' })).toBe(2);
      expect(await app.locks.holdCount('count:1')).toBe(0); // this context holds count:2 only
    });
    await Promise.all([a.release(), b.release()]);
    await app.locks.run('count:context', async () => {
      const writes = [await app.locks.writeLock('count:rw'), await app.locks.writeLock('count:rw')];
      const read = await app.locks.readLock('count:rw');
      expect(await app.locks.holdCount('count:rw', { mode: 'write' })).toBe(2);
      expect(await app.locks.holdCount('count:rw', { mode: 'read' })).toBe(1);
      expect(await app.locks.holdCount('count:rw')).toBe(2); // an exclusive lock and the write side share a holder
      await Promise.all([...writes, read].map((h) => h.release()));
    });
  });

  it('releases a handle and a group taken with `await using` at the end of their block, also when the block throws', async () => {
    {
      await using lock = await app.locks.acquire('using:one');
      await using group = await app.locks.acquire(['using:a', 'using:b']);
      expect(lock.isHeld && group.isHeld).toBe(true);
      expect(await app.locks.isLocked('using:b')).toBe(true);
    }
    for (const key of ['using:one', 'using:a', 'using:b']) expect(await app.locks.isLocked(key)).toBe(false);
    const failure = new RangeError('inside the block');
    const block = async () => {
      await using lock = await app.locks.acquire('using:thrown');
      expect(lock.isHeld).toBe(true);
      throw failure;
    };
    await expect(block()).rejects.toBe(failure);
    expect(await app.locks.isLocked('using:thrown')).toBe(false);
  });
});
