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
