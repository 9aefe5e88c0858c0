import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import type { Redis } from 'ioredis';
import { once } from 'node:events';
import { performance } from 'node:perf_hooks';
import { LockBackendError, type LockHandle } from '../../lib/index.js';
import { RedisServer, subscribers, tcpProxy, until } from '../support/redis-server.js';
import { nextEvent, startLockApp, type LockApp } from '../support/lock-testing.js';

/** The ids of the connections subscribed to at least one channel. */
async function subscribedConnections(raw: Redis): Promise<string[]> {
  const list = String(await raw.call('CLIENT', 'LIST', 'TYPE', 'pubsub'));
  return [...list.matchAll(/^id=(\d+) .* sub=(\d+) /gm)].filter((m) => Number(m[2]) > 0).map((m) => m[1]!);
}

/**
 * The waiters' subscriber connection dropped and reconnected: nestjs-locked subscribes to its
 * release channels again itself (ioredis's own resubscription, in every release up to 5.11.1 and
 * 6.0.0, leaves a rejection unhandled when the connection closes before Redis answers it, and Node
 * ends the process on an unhandled rejection by default; 6.1.0 catches it).
 */
describe('the release subscriber after a dropped connection', () => {
  let redis: RedisServer;
  let raw: Redis;
  let holderApp: LockApp;
  beforeAll(async () => {
    redis = await RedisServer.start();
    raw = redis.client();
    holderApp = await startLockApp({ redis: redis.url, leaseMs: 60_000 });
  });
  afterAll(async () => {
    await holderApp?.close();
    await redis?.stop();
  });

  /** `holders` (`holderApp` unless given) holds `key` and `app` waits for it, subscribed to its release channel. */
  async function waiterBehindHolder(app: LockApp, key: string, holders = holderApp): Promise<{ holder: LockHandle; waiting: Promise<LockHandle> }> {
    const holder = await holders.locks.acquire(key);
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === key);
    const waiting = app.locks.acquire(key);
    // Awaited by the test; handled here, so a test that fails earlier reports its own failure.
    waiting.catch(() => undefined);
    await contended;
    await until(async () => (await subscribers(raw, key)) === 1, 10_000, 'the waiter subscribed');
    return { holder, waiting };
  }

  it('watches its release channels again, so a later release wakes the waiter by message, not by lease', async () => {
    const key = 'resubscribe:wake';
    const app = await startLockApp({ redis: redis.url, leaseMs: 60_000, waitMs: 120_000 });
    try {
      const { holder, waiting } = await waiterBehindHolder(app, key);
      expect(Number(await raw.call('CLIENT', 'KILL', 'TYPE', 'pubsub'))).toBe(1);
      // Killed: nobody watches the channel until the subscriber reconnected and subscribed again.
      expect(await subscribers(raw, key)).toBe(0);
      await until(async () => (await subscribers(raw, key)) === 1, 10_000, 'the channel subscribed again');
      const releasedAt = performance.now();
      await holder.release();
      const lock = await waiting;
      // The holder's lease is 60 s: only the release message hands the lock over this fast.
      expect(performance.now() - releasedAt).toBeLessThan(5_000);
      await lock.release();
      expect(app.logger.at('warn')).toEqual([]);
    } finally {
      await app.close();
    }
  });

  it('warns when Redis refuses the resubscription, and its waiter still gets the lock once the holder releases', async () => {
    const key = 'resubscribe:refused';
    // A user of its own for the waiter's app, whose channel access the test takes away (Redis then
    // drops its subscribed connections) and gives back. The holder's app keeps the default user.
    await raw.call('ACL', 'SETUSER', 'waiter', 'on', '>waiter-password', '~*', '&*', '+@all');
    // A 1 s lease (renewed by the holder's watchdog): a waiter that missed the release message retries within it.
    const holderShort = await startLockApp({ redis: redis.url, leaseMs: 1_000 });
    const app = await startLockApp({ redis: `redis://waiter:waiter-password@127.0.0.1:${redis.port}`, leaseMs: 60_000, waitMs: 120_000 });
    try {
      const { holder, waiting } = await waiterBehindHolder(app, key, holderShort);
      await raw.call('ACL', 'SETUSER', 'waiter', 'resetchannels');
      // Redis closed the subscriber; it reconnects, and its SUBSCRIBE is refused (NOPERM).
      await until(async () => app.logger.at('warn').length > 0, 10_000, 'the refused resubscription logged');
      expect(app.logger.at('warn')).toEqual([expect.stringMatching(/could not resubscribe to 1 release channel\(s\) after a reconnect.*NOPERM/)]);
      expect(await subscribers(raw, key)).toBe(0);
      // Channels allowed again (the waiter's app publishes on this one when it releases), but nobody
      // watches this one: the release message goes unheard, and the waiter retries within the lease.
      await raw.call('ACL', 'SETUSER', 'waiter', 'allchannels');
      await holder.release();
      const lock = await waiting;
      expect(lock.key).toBe(key);
      await lock.release();
    } finally {
      await app.close();
      await holderShort.close();
    }
  });

  it('subscribes to nothing, and warns of nothing, when it reconnects with no release channel left', async () => {
    const key = 'resubscribe:none';
    const app = await startLockApp({ redis: redis.url, leaseMs: 60_000, waitMs: 120_000 });
    try {
      const { holder, waiting } = await waiterBehindHolder(app, key);
      // The app's subscriber connection: the only one subscribed to anything now.
      const [id] = await subscribedConnections(raw);
      await holder.release();
      await (await waiting).release();
      // Its last waiter gone, the channel is given up; the subscriber connection stays.
      await until(async () => (await subscribers(raw, key)) === 0, 10_000, 'the channel given up');
      const sub = (app.locks as unknown as { store: { subscriber: Redis } }).store.subscriber;
      const ready = once(sub, 'ready');
      expect(Number(await raw.call('CLIENT', 'KILL', 'ID', id!))).toBe(1);
      await ready;
      // Whatever the reconnect sent went before this PING, on the same connection.
      expect(await sub.ping()).toBe('PONG');
      await new Promise((resolve) => setImmediate(resolve));
      expect(app.logger.at('warn')).toEqual([]);
      expect(await subscribedConnections(raw)).toEqual([]);
    } finally {
      await app.close();
    }
  });

  it('shuts down without an unhandled rejection while its resubscription is unanswered', async () => {
    const key = 'resubscribe:shutdown';
    const link = await tcpProxy(redis.port);
    const app = await startLockApp({ redis: `redis://127.0.0.1:${link.port}`, leaseMs: 60_000, waitMs: 120_000 });
    let closed = false;
    try {
      const { holder, waiting } = await waiterBehindHolder(app, key);
      const before = await subscribedConnections(raw);
      expect(before).toHaveLength(1);
      // Every connection of the app drops; from the next SUBSCRIBE on (the resubscription, sent
      // once the subscriber is ready again), Redis's replies never arrive.
      link.cut();
      link.holdRepliesFrom('subscribe');
      // Redis may see the old connection close after the new one subscribed: told apart by id.
      await until(async () => (await subscribedConnections(raw)).some((id) => !before.includes(id)), 10_000, 'the resubscription run in Redis');
      await app.close();
      closed = true;
      await expect(waiting).rejects.toBeInstanceOf(LockBackendError);
      // An unhandled rejection would come once the microtasks ran out, before the next macrotask,
      // and fail this test (jest-circus fails the test it comes in; test/harness checks that).
      await new Promise((resolve) => setImmediate(resolve));
      await holder.release();
    } finally {
      if (!closed) await app.close();
      await link.close();
    }
  });
});
