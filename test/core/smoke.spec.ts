import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { RedisServer } from '../support/redis-server.js';
import { startLockApp, type LockApp } from '../support/lock-testing.js';

describe('smoke', () => {
  let redis: RedisServer;
  let app: LockApp;
  beforeAll(async () => {
    redis = await RedisServer.start();
    app = await startLockApp({ redis: redis.url });
  });
  afterAll(async () => {
    await app?.close();
    await redis?.stop();
  });

  it('acquires and releases', async () => {
    const h = await app.locks.acquire('a');
    expect(await app.locks.isLocked('a')).toBe(true);
    await h.release();
    expect(await app.locks.isLocked('a')).toBe(false);
  });

});
