import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import type { Redis } from 'ioredis';
import { performance } from 'node:perf_hooks';
import { LockNotAcquiredError } from '../../lib/index.js';
import { Fixture } from '../support/children.js';
import { RedisServer } from '../support/redis-server.js';
import { nextEvent, startLockApp, type LockApp } from '../support/lock-testing.js';

const QUEUE_TIMEOUT = 1_000;

describe('fair mode', () => {
  let redis: RedisServer;
  let raw: Redis;
  let app: LockApp;
  beforeAll(async () => {
    redis = await RedisServer.start();
    raw = redis.client();
    app = await startLockApp({ redis: redis.url, fairQueueTimeoutMs: QUEUE_TIMEOUT });
  });
  afterAll(async () => {
    await app?.close();
    await redis?.stop();
  });

  it('grants in request order across 2 processes', async () => {
    const key = 'fair:order';
    const children = [0, 1].map(() => new Fixture('fair-waiter', [redis.url, key, String(QUEUE_TIMEOUT)]));
    try {
      await Promise.all(children.map((c) => c.next('ready')));
      const holder = await app.locks.acquire(key, { fair: true });
      for (let id = 0; id < 8; id++) {
        const child = children[id % 2]!;
        child.send({ type: 'wait', id });
        await child.next('queued', (m) => m.owner === `waiter-${id}`);
      }
      await holder.release();
      await Promise.all(children.map((c, i) => c.next('granted', (m) => m.id === 6 + i)));
      expect(await raw.lrange('order', 0, -1)).toEqual(['0', '1', '2', '3', '4', '5', '6', '7']);
      for (const c of children) c.send({ type: 'finish' });
      await Promise.all(children.map((c) => c.next('done')));
      expect(await raw.exists(`lock:{${key}}:queue`, `lock:{${key}}:queue:timeouts`)).toBe(0);
    } finally {
      await Promise.all(children.map((c) => c.stop()));
    }
  });

  it('does not stall behind a waiter that crashed (SIGKILL)', async () => {
    const key = 'fair:crash';
    const child = new Fixture('fair-waiter', [redis.url, key, String(QUEUE_TIMEOUT)]);
    try {
      await child.next('ready');
      const holder = await app.locks.acquire(key, { fair: true });
      child.send({ type: 'wait', id: 99 });
      await child.next('queued');
      const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === key && e.owner !== holder.owner);
      const behind = app.locks.acquire(key, { fair: true, waitMs: 30_000 });
      await contended;
      expect(await raw.lrange(`lock:{${key}}:queue`, 0, -1)).toEqual(['waiter-99', expect.any(String)]);
      child.kill('SIGKILL');
      await child.exited;
      const releasedAt = performance.now();
      await holder.release();
      const lock = await behind;
      // The dead head keeps its place for at most the queue timeout, then the next waiter goes.
      expect(performance.now() - releasedAt).toBeLessThan(QUEUE_TIMEOUT + 1_000);
      expect(await raw.lrange(`lock:{${key}}:queue`, 0, -1)).toEqual([]);
      await lock.release();
    } finally {
      await child.stop();
    }
  });

  it('leaves no queue entry and no subscription behind an aborted or timed-out wait', async () => {
    const key = 'fair:abort';
    const holder = await app.locks.acquire(key, { fair: true });
    const controller = new AbortController();
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === key);
    const waiting = app.locks.acquire(key, { fair: true, waitMs: 60_000, signal: controller.signal });
    await contended;
    expect(await raw.llen(`lock:{${key}}:queue`)).toBe(1);
    controller.abort(new Error('client went away'));
    await expect(waiting).rejects.toThrow('client went away');
    expect(await raw.exists(`lock:{${key}}:queue`, `lock:{${key}}:queue:timeouts`)).toBe(0);
    await expect(app.locks.acquire(key, { fair: true, waitMs: 100 })).rejects.toBeInstanceOf(LockNotAcquiredError);
    expect(await app.locks.tryAcquire(key, { fair: true })).toBeNull();
    expect(await raw.exists(`lock:{${key}}:queue`, `lock:{${key}}:queue:timeouts`)).toBe(0);
    const store = (app.locks as unknown as { store: { waitState: { channels: number; waiters: number } } }).store;
    expect(store.waitState).toEqual({ channels: 0, waiters: 0 });
    await holder.release();
  });

  it('wakes the next waiter when the head leaves the queue of a free lock', async () => {
    // A queue timeout of 20 s: the waiter below would otherwise sleep up to 10 s between attempts.
    const patient = await startLockApp({ redis: redis.url, fairQueueTimeoutMs: 20_000 });
    try {
      const key = 'fair:leave';
      const holder = await patient.locks.acquire(key, { fair: true });
      const contended = nextEvent(patient.locks.events$, 'contended', (e) => e.key === key);
      const second = patient.locks.acquire(key, { fair: true, waitMs: 60_000 });
      await contended;
      // A waiter ahead of it that will never come back for the lock (a process about to give up).
      await raw.lpush(`lock:{${key}}:queue`, 'ghost');
      await raw.zadd(`lock:{${key}}:queue:timeouts`, Date.now() + 60_000, 'ghost');
      await holder.release(); // announces 'ghost', which nobody answers
      const store = (patient.locks as unknown as { store: { abandon(k: string, o: string, m: 'exclusive', fair: boolean): Promise<void> } }).store;
      const leftAt = performance.now();
      await store.abandon(key, 'ghost', 'exclusive', true);
      const lock = await second;
      expect(performance.now() - leftAt).toBeLessThan(1_000);
      await lock.release();
    } finally {
      await patient.close();
    }
  });
});
