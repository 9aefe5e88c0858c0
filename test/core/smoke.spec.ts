import { describe, expect, it } from '@jest/globals';
import type { RedisServer } from '../support/redis-server.js';
import { usePrivateLockApp, type LockApp } from '../support/lock-testing.js';

describe('smoke', () => {
  let redis: RedisServer;
  let app: LockApp;
  usePrivateLockApp({}, (started) => ({ redis, app } = started));

  it('acquires and releases', async () => {
    const h = await app.locks.acquire('a');
    expect(await app.locks.isLocked('a')).toBe(true);
    await h.release();
    expect(await app.locks.isLocked('a')).toBe(false);
  });

});
