import { describe, expect, it } from '@jest/globals';
import { createHash } from 'node:crypto';
import { ACQUIRE } from '../../lib/store/redis/lock.scripts.js';
import { silentPort, until, type RedisServer } from '../support/redis-server.js';
import { listenerCounts, stall, startLockApp, usePrivateLockApp, type LockApp } from '../support/lock-testing.js';

describe('LockService.health()', () => {
  let redis: RedisServer;
  let app: LockApp;
  usePrivateLockApp({ leaseMs: 3_000 }, (started) => ({ redis, app } = started));

  it('is up with its held locks and no overdue renewal, and reloads scripts Redis forgot', async () => {
    const lock = await app.locks.acquire('h:1');
    await redis.client().script('FLUSH');
    expect(await app.locks.health()).toEqual({ status: 'up', store: expect.stringMatching(/^redis 127\.0\.0\.1:\d+$/), heldLocks: 1, renewalOverdueMs: 0 });
    const acquireSha = createHash('sha1').update(ACQUIRE).digest('hex');
    expect(await redis.client().script('EXISTS', acquireSha)).toEqual([1]); // loaded again by the check
    await lock.release();
  });

  it('says how late the most overdue renewal is when the event loop was blocked past it', async () => {
    // Renewed a third of the way into its 3 s lease; the loop is blocked 1.5 s, past that moment.
    const lock = await app.locks.acquire('h:overdue', { leaseMs: 3_000, watchdog: true });
    stall(1_500); // the watchdog's timer cannot run meanwhile
    const health = app.locks.health(); // read before any timer runs
    expect((await health).renewalOverdueMs).toBeGreaterThanOrEqual(400);
    await lock.release();
  });

  it('is down while its Redis is a replica (made one behind its back: every lock step would fail READONLY), and up once it is a master again', async () => {
    const master = await silentPort();
    const raw = redis.client();
    try {
      await raw.replicaof('127.0.0.1', String(master.port));
      expect(await app.locks.health()).toMatchObject({ status: 'down', error: expect.stringMatching(/^redis 127\.0\.0\.1:\d+ is a replica of 127\.0\.0\.1:\d+: every lock step writes/) });
    } finally {
      await raw.replicaof('NO', 'ONE');
      await master.close();
    }
    expect((await app.locks.health()).status).toBe('up');
  });

  it('is down, without throwing, while Redis is frozen, and up again afterwards', async () => {
    redis.pause();
    try {
      const health = await app.locks.health(300);
      expect(health).toMatchObject({ status: 'down', error: expect.stringMatching(/no answer .* within 300 ms/) });
    } finally {
      redis.resume();
    }
    expect((await app.locks.health()).status).toBe('up');
  });

  it('is down while Redis is gone, and a probe every time meanwhile leaves at most one wait for the connection on the client', async () => {
    const own = redis.client();
    await own.ping();
    const before = listenerCounts(own);
    const probed = await startLockApp({ redis: own });
    const during = listenerCounts(own);
    try {
      const gone = new Promise((resolve) => own.once('close', resolve));
      await redis.kill();
      await gone;
      // More probes than Node's default of 10 listeners per event, which would warn.
      for (let i = 0; i < 12; i++) expect((await probed.locks.health(20)).status).toBe('down');
      const waiting = listenerCounts(own);
      // ioredis holds a 'ready' listener of its own while a reconnection attempt is in flight
      // (status connecting or connect): seen once in CI, on Valkey.
      const reconnecting = own.status === 'connecting' || own.status === 'connect' ? 1 : 0;
      expect(waiting.end).toBe((during.end ?? 0) + 1);
      expect([(during.ready ?? 0) + 1, (during.ready ?? 0) + 1 + reconnecting]).toContain(waiting.ready);
    } finally {
      await redis.launch();
    }
    await until(async () => (await probed.locks.health()).status === 'up', 10_000, 'never up again');
    expect(listenerCounts(own)).toEqual(during);
    await probed.close();
    expect(listenerCounts(own)).toEqual(before);
  });

  it('is down once the application has shut down, without asking Redis (a readiness probe during shutdown)', async () => {
    const closing = await startLockApp({ redis: redis.url });
    await closing.locks.acquire('h:closing');
    await closing.close();
    expect(await closing.locks.health()).toEqual({
      status: 'down',
      store: expect.stringMatching(/^redis 127\.0\.0\.1:\d+$/),
      heldLocks: 0,
      renewalOverdueMs: 0,
      error: 'the lock module has shut down',
    });
  });
});
