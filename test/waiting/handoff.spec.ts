import { describe, expect, it } from '@jest/globals';
import type { Redis } from 'ioredis';
import { performance } from 'node:perf_hooks';
import type { LockEvent } from '../../lib/index.js';
import type { RedisServer } from '../support/redis-server.js';
import { nextEvent, nextEvents, usePrivateLockApp, type LockApp } from '../support/lock-testing.js';

describe('handoff without polling', () => {
  let redis: RedisServer;
  let raw: Redis;
  let app: LockApp;
  let holderApp: LockApp;
  usePrivateLockApp({ waitMs: 120_000, leaseMs: 60_000 }, (started) => ({ redis, raw, app, other: holderApp } = started), { leaseMs: 60_000 });

  it('with 8 waiters, follows each release with exactly one acquisition, woken by the release', async () => {
    const key = 'handoff:8';
    const holder = await holderApp.locks.acquire(key);
    const events: LockEvent['type'][] = [];
    const subscription = app.locks.events$.subscribe((e) => {
      if (e.key === key && (e.type === 'acquired' || e.type === 'released')) events.push(e.type);
    });
    const contended = nextEvents(app.locks.events$, 'contended', 8);
    const waiters = Array.from({ length: 8 }, () =>
      app.locks.run(key, () => new Promise((r) => setTimeout(r, 2)), { waitMs: 120_000 }),
    );
    await contended;
    const releasedAt = performance.now();
    await holder.release();
    await Promise.all(waiters);
    const elapsed = performance.now() - releasedAt;
    subscription.unsubscribe();
    // Acquired, released, acquired, released...: never two holders, never a release without a successor.
    expect(events).toEqual(Array.from({ length: 16 }, (_, i) => (i % 2 === 0 ? 'acquired' : 'released')));
    // Leases are 60 s and waits 120 s: only release messages can hand over 8 times this fast.
    expect(elapsed).toBeLessThan(5_000);
  });

  it('ends a wait within the holder\'s lease when the release message is lost (subscriber killed)', async () => {
    const key = 'lost-message';
    const holder = await holderApp.locks.acquire(key, { leaseMs: 3_000 });
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === key);
    const started = performance.now();
    const waiting = app.locks.acquire(key, { waitMs: 120_000 });
    await contended;
    // Kill the waiter's subscriber connection, and release while it is gone: the message is lost.
    const killed = await raw.call('CLIENT', 'KILL', 'TYPE', 'pubsub');
    expect(Number(killed)).toBeGreaterThanOrEqual(1);
    await holder.release();
    const lock = await waiting;
    expect(performance.now() - started).toBeLessThan(3_000);
    await lock.release();
  });

  it('shares one subscriber connection among all waiters, subscribing once per key', async () => {
    const keys = ['sub:a', 'sub:b'];
    const holders = await Promise.all(keys.map((k) => holderApp.locks.acquire(k)));
    const contended = nextEvents(app.locks.events$, 'contended', 6);
    const waiters = keys.flatMap((k) => [0, 1, 2].map(() => app.locks.run(k, async () => undefined)));
    await contended;
    const clients = String(await raw.call('CLIENT', 'LIST', 'TYPE', 'pubsub')).trim().split('\n');
    expect(clients).toHaveLength(1);
    expect(clients[0]).toMatch(/ sub=2 /);
    await Promise.all(holders.map((h) => h.release()));
    await Promise.all(waiters);
    const store = (app.locks as unknown as { store: { waitState: { channels: number; waiters: number } } }).store;
    expect(store.waitState).toEqual({ channels: 0, waiters: 0 });
  });
});
