import { describe, expect, it } from '@jest/globals';
import { Injectable } from '@nestjs/common';
import { AsyncResource } from 'node:async_hooks';
import { performance } from 'node:perf_hooks';
import { LockBackendError, Locked, type LockGroup, type LockHandle, type LockLostError } from '../../lib/index.js';
import type { Redis } from 'ioredis';
import { until, type RedisServer } from '../support/redis-server.js';
import { asleep, nextEvent, nextEvents, stallInTimer, startLockApp, usePrivateLockApp, waitRegistered, within, type LockApp } from '../support/lock-testing.js';

/** Every step a caller awaits gives up after this long; the rejection says so. */
const BOUND = /^Redis failed during \w+ of "[^"]+": no answer within 1000 ms\./;

/**
 * Redis stops answering (SIGSTOP: the connections stay open, so ioredis waits for as long as Redis
 * does) while a lock is held. The leases here (30 s) outlast every test: a lock found free
 * afterwards was freed by the release that was still sent, not by its lease.
 */
describe('steps that Redis does not answer', () => {
  let redis: RedisServer;
  let app: LockApp;
  let raw: Redis;
  usePrivateLockApp({ leaseMs: 30_000 }, (started) => ({ redis, raw, app } = started));
  const outside = new AsyncResource('another-owner');

  /** Awaits `during` (which freezes Redis), then resumes Redis whatever happened. */
  async function frozen<T>(during: () => Promise<T>): Promise<T> {
    try {
      return await within(during(), 5_000);
    } finally {
      redis.resume();
    }
  }

  it('run() returns fn\'s value when the release is not answered, reports release-failed, and the release runs once Redis is back', async () => {
    const failed = nextEvent(app.locks.events$, 'release-failed', (e) => e.key === 'frozen:run');
    const value = await frozen(() =>
      app.locks.run('frozen:run', () => {
        redis.pause();
        return 'done';
      }),
    );
    expect(value).toBe('done');
    expect(((await failed).error as Error).message).toMatch(BOUND);
    expect(app.logger.at('error')).toContainEqual(expect.stringMatching(/^could not release "frozen:run"; its lease will free it: /));
    // Redis runs the release before this read, which follows it on the same connection.
    expect(await app.locks.isLocked('frozen:run')).toBe(false);
  });

  it('a group\'s releases are sent together: run([keys]) waits for one bound, not one per key', async () => {
    const keys = ['frozen:g1', 'frozen:g2', 'frozen:g3'];
    const failed = nextEvents(app.locks.events$, 'release-failed', 3);
    let released = 0;
    const value = await frozen(() =>
      app.locks.run(keys, () => {
        redis.pause();
        released = performance.now();
        return 'done';
      }),
    );
    const waited = performance.now() - released;
    expect(value).toBe('done');
    expect((await failed).map((e) => e.key).sort()).toEqual(keys);
    // One after the other they would take three bounds (3 s and more).
    expect(waited).toBeLessThan(2_500);
    for (const key of keys) expect(await app.locks.isLocked(key)).toBe(false);

    // LockGroup.release() likewise, and it rejects with the first failure.
    const group = await app.locks.acquire(keys);
    const rejected = await frozen(() => {
      redis.pause();
      const started = performance.now();
      return group.release().then(
        () => undefined,
        (error: unknown) => ({ error, waited: performance.now() - started }),
      );
    });
    expect(rejected?.error).toBeInstanceOf(LockBackendError);
    expect((rejected?.error as Error).message).toMatch(BOUND);
    expect(rejected?.waited).toBeLessThan(2_500);
    for (const key of keys) expect(await app.locks.isLocked(key)).toBe(false);
  });

  it('release(), extend(), the reads and forceUnlock() reject with LockBackendError, and leave the lock as Redis then finds it', async () => {
    const lock: LockHandle = await app.locks.acquire('frozen:steps');
    const other = await app.locks.acquire('frozen:other');
    // Within 5 s: the watchdog's first renewal of the 30 s lease comes at 10 s.
    const lost = nextEvent(app.locks.events$, 'lost', (e) => e.key === 'frozen:other', 5_000);
    const results = await frozen(() => {
      redis.pause();
      return Promise.allSettled([
        lock.extend(20_000),
        app.locks.isLocked('frozen:steps'),
        app.locks.remainingTtl('frozen:steps'),
        app.locks.holdCount('frozen:steps', { owner: lock.owner }),
        lock.release(),
        app.locks.forceUnlock('frozen:other'),
      ]);
    });
    for (const result of results) {
      expect(result.status).toBe('rejected');
      const error = (result as PromiseRejectedResult).reason as LockBackendError;
      expect(error).toBeInstanceOf(LockBackendError);
      expect(error.message).toMatch(BOUND);
    }
    // The force-unlock ran late, and its holder here is told when its reply comes, not at its next renewal.
    expect((await lost).reason).toBe('taken');
    expect((other.signal.reason as LockLostError).reason).toBe('taken');
    expect(await app.locks.isLocked('frozen:steps')).toBe(false);
    expect(await app.locks.isLocked('frozen:other')).toBe(false);
    await other.release();
  });

  it('a force-unlock that ran late tells the holders it deleted, not an acquisition sent after it (Redis ran that one after the force-unlock)', async () => {
    const before = await app.locks.acquire('frozen:late');
    const lost = nextEvent(app.locks.events$, 'lost', (e) => e.key === 'frozen:late', 5_000);
    redis.pause();
    let after: Promise<LockHandle> | undefined;
    try {
      const failure = await within(app.locks.forceUnlock('frozen:late'), 5_000).catch((e: unknown) => e);
      expect(failure).toBeInstanceOf(LockBackendError);
      // Another owner of this process asks for the key while Redis is still frozen: its attempt
      // is sent after the force-unlock, on the same connection.
      // (A 600 ms lease renewed by the watchdog every 200 ms, so the test can wait for renewals.)
      after = app.locks.acquire('frozen:late', { waitMs: 10_000, leaseMs: 600, watchdog: true });
    } finally {
      redis.resume();
    }
    const taken = await lost;
    expect(taken.owner).toBe(before.owner);
    expect(taken.reason).toBe('taken');
    const next = await after!;
    expect(next.owner).not.toBe(before.owner);
    // Redis ran the attempt after the force-unlock: the new holder holds the key, and a read
    // sent after both (and answered after them) finds it held and untold.
    expect(await app.locks.holdCount('frozen:late', { owner: next.owner })).toBe(1);
    // Still untold two renewals later, which Redis granted.
    for (let i = 0; i < 2; i++) await nextEvent(app.locks.events$, 'renewed', (e) => e.owner === next.owner);
    expect(next.signal.aborted).toBe(false);
    expect(app.logger.at('warn').filter((m) => m.includes('frozen:late'))).toHaveLength(1);
    await next.release();
  });

  it.each([
    ['a plain', {}],
    ['a fair', { fair: true }],
  ])("%s lock whose fixed lease runs out while its owner's re-entry waits for Redis is not taken back from under the hold that re-entry is then granted", async (_, kind) => {
    const key = `frozen:reentry:${'fair' in kind ? 'fair' : 'plain'}`;
    const outer = await app.locks.acquire(key, { ...kind, leaseMs: 200 });
    const lost = nextEvent(app.locks.events$, 'lost', (e) => e.key === key && e.owner === outer.owner, 5_000);
    let inner: LockHandle;
    try {
      inner = await frozen(() =>
        outer.run(async () => {
          redis.pause();
          // Sent while the outer lock is held here: a re-entry, which Redis answers only once
          // it runs again, after the outer lease has run out here.
          const reentry = app.locks.acquire(key, kind);
          expect((await lost).reason).toBe('lease-expired');
          redis.resume();
          return reentry;
        }),
      );
    } finally {
      redis.resume();
    }
    try {
      // The owner holds the lock through the new handle, and Redis agrees: no other owner gets it.
      expect(inner.signal.aborted).toBe(false);
      expect(await app.locks.holdCount(key, { owner: inner.owner })).toBeGreaterThanOrEqual(1);
      expect(await outside.runInAsyncScope(() => app.locks.tryAcquire(key, kind))).toBeNull();
    } finally {
      await inner.release();
    }
  });

  it("a fair lock whose fixed lease runs out here while its owner waits for it again is not taken back from under the handover that wait is given", async () => {
    const key = 'frozen:reentry:wait';
    const outer = await app.locks.acquire(key, { fair: true, leaseMs: 1_500 });
    const acquiredAt = performance.now();
    // Redis loses the lock (as a failover to a replica that missed it would), and another owner
    // takes it; nothing tells this one (a fixed lease is not renewed).
    expect(await raw.del(`lock:{${key}}`)).toBe(1);
    const holder = await outside.runInAsyncScope(() => app.locks.acquire(key, { fair: true }));
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === key && e.owner === outer.owner);
    // Its owner asks for the lock again, and waits (it sleeps 2.5 s between attempts: half its handover lease).
    const waiting = outer.run(() => app.locks.acquire(key, { fair: true, waitMs: 10_000 }));
    await contended;
    await waitRegistered(raw, key, outer.owner);
    expect(outer.signal.aborted).toBe(false);
    // Redis runs the holder's release, which hands the lock to the waiter, 300 ms from now, while
    // this process is stalled until the outer lease has run out here. Right after the stall, before
    // this process reads the handover message, reading the outer signal finds the loss.
    const pausedAt = performance.now();
    await raw.client('PAUSE', 300, 'ALL');
    const released = holder.release();
    let lostAfterStall = false;
    await stallInTimer(Math.max(acquiredAt + 1_600, pausedAt + 500) - performance.now(), () => (lostAfterStall = outer.signal.aborted));
    await released;
    expect(lostAfterStall).toBe(true);
    const inner = await waiting;
    try {
      expect(inner.signal.aborted).toBe(false);
      expect(await app.locks.holdCount(key, { owner: inner.owner })).toBe(1);
      expect(await outside.runInAsyncScope(() => app.locks.tryAcquire(key, { fair: true }))).toBeNull();
    } finally {
      await inner.release();
    }
  });

  it('a hold kept for minHoldMs that its timer gives back while Redis does not answer: logged after the bound, and given back once Redis is back', async () => {
    @Injectable()
    class Docs {
      @Locked('kept:<0>', { mode: 'write', minHoldMs: 300 })
      async rewrite(id: string) {
        return id;
      }
    }
    const jobs = await startLockApp({ redis: redis.url, leaseMs: 30_000 }, [Docs]);
    try {
      // The job reads the key after the call, so a timer gives the kept write hold back at 300 ms.
      const read = await jobs.locks.run('kept:job', async () => {
        await jobs.moduleRef.get(Docs).rewrite('1');
        return jobs.locks.readLock('kept:1');
      });
      const given = /^could not give back the hold kept for minHoldMs of "kept:1"; it stays until the lock's lease ends: LockBackendError: Redis failed during release of "kept:1": no answer within 1000 ms\./;
      await frozen(async () => {
        redis.pause();
        // Before, the give-back waited for Redis as long as the connection stayed open, and nothing was logged.
        await until(async () => jobs.logger.at('error').some((line) => given.test(line)), 4_000, 'the failed give-back logged');
      });
      // Redis runs the give-back before these reads, which follow it on the same connection.
      expect(await jobs.locks.holdCount('kept:1', { owner: read.owner, mode: 'write' })).toBe(0);
      expect(await jobs.locks.holdCount('kept:1', { owner: read.owner, mode: 'read' })).toBe(1);
      await read.release();
      expect(await raw.exists('lock:{kept:1}')).toBe(0);
    } finally {
      await jobs.close();
    }
  });

  it('a fair waiter and a waiting writer whose wait ends while Redis does not answer reject with LockBackendError (leaving their queue is not waited for)', async () => {
    const fairHolder = await app.locks.acquire('frozen:fair', { fair: true });
    const reader = await app.locks.acquire('frozen:rw', { mode: 'read' });
    const waiters = [
      app.locks.acquire('frozen:fair', { fair: true, waitMs: 1_000 }),
      app.locks.acquire('frozen:rw', { mode: 'write', waitMs: 1_000 }),
    ].map((waiting) => waiting.then(() => 'acquired', (error: unknown) => error));
    await until(async () => asleep(app, 'frozen:fair') === 1 && asleep(app, 'frozen:rw') === 1, 10_000, 'both waiters asleep');
    const outcomes = await frozen(() => {
      redis.pause();
      return Promise.all(waiters);
    });
    for (const outcome of outcomes) {
      expect(outcome).toBeInstanceOf(LockBackendError);
      expect((outcome as Error).message).toMatch(BOUND);
    }
    await fairHolder.release();
    await reader.release();
    // They left their queue once Redis was back: nothing of them stays (the fencing counters do).
    const left = [...(await redis.client().keys('lock:{frozen:fair}*')), ...(await redis.client().keys('lock:{frozen:rw}*'))];
    expect(left.sort()).toEqual(['lock:{frozen:fair}:fence', 'lock:{frozen:rw}:fence']);
  });
});

/**
 * `stepTimeoutMs` sets that bound: shorter for an app that would rather fail fast, longer for one
 * whose Redis has pauses of its own (a fork for a snapshot of a large dataset, a distant region).
 */
describe('stepTimeoutMs', () => {
  let redis: RedisServer;
  let app: LockApp;
  let patient: LockApp;
  usePrivateLockApp({ leaseMs: 30_000, stepTimeoutMs: 250 }, (started) => ({ redis, app, other: patient } = started), { leaseMs: 30_000, stepTimeoutMs: 3_000 });

  it('a shorter bound: every step and an acquisition attempt that does not wait give up after it, long before the default 1000 ms', async () => {
    const lock = await app.locks.acquire('bound:short');
    const other = await app.locks.acquire('bound:short-other');
    redis.pause();
    const started = performance.now();
    const results = await within(
      Promise.allSettled([
        lock.extend(20_000),
        app.locks.isLocked('bound:short'),
        app.locks.remainingTtl('bound:short'),
        app.locks.holdCount('bound:short', { owner: lock.owner }),
        app.locks.forceUnlock('bound:short-other'),
        app.locks.acquire('bound:short-free', { waitMs: 0 }),
        lock.release(),
      ]),
      5_000,
    ).finally(() => redis.resume());
    const waited = performance.now() - started;
    for (const result of results) {
      expect(result.status).toBe('rejected');
      const error = (result as PromiseRejectedResult).reason as LockBackendError;
      expect(error).toBeInstanceOf(LockBackendError);
      expect(error.message).toMatch(/: no answer within 250 ms\./);
    }
    expect(waited).toBeLessThan(900);
    // Each step still ran once Redis was back, in order: the release freed the lock, the
    // force-unlock deleted the other, and the attempt's late grant was given back.
    expect(await app.locks.isLocked('bound:short')).toBe(false);
    expect(await app.locks.isLocked('bound:short-other')).toBe(false);
    await until(async () => !(await app.locks.isLocked('bound:short-free')), 5_000, 'the late grant was never given back');
    await other.release().catch(() => undefined);
  });

  /**
   * An owner (here a context's) tries again after an attempt it gave up on while Redis was frozen.
   * Redis grants the abandoned attempt once it is back, and this process gives that grant back when
   * its reply comes. Sent before that, the retry would be counted on top of it: a fresh
   * acquisition reported as a re-entry (hold count 2, `reentered`).
   */
  it.each<[string, { fair?: boolean; mode?: 'read' }, boolean]>([
    ['plain', {}, false],
    ['fair', { fair: true }, false],
    ['read', { mode: 'read' }, false],
    ['group', {}, true],
  ])('a %s retry sent while an abandoned attempt of its owner is unanswered is a fresh acquisition once Redis is back', async (kind, options, group) => {
    const keys = group ? [`bound:retry-${kind}-a`, `bound:retry-${kind}-b`] : [`bound:retry-${kind}`];
    const take = (waitMs: number): Promise<LockHandle | LockGroup> =>
      group ? app.locks.acquire(keys, { ...options, waitMs }) : app.locks.acquire(keys[0]!, { ...options, waitMs });
    const events: string[] = [];
    const subscription = app.locks.events$.subscribe((e) => keys.includes(e.key) && events.push(`${e.type} ${e.key}`));
    try {
      await app.locks.run('bound:retry-outer', async () => {
        let retry: ReturnType<typeof take>;
        redis.pause();
        try {
          expect(await within(take(0), 5_000).catch((e: unknown) => e)).toBeInstanceOf(LockBackendError);
          // Sent while Redis is still frozen, in the same context: the same owner.
          retry = take(10_000);
        } finally {
          redis.resume();
        }
        const got = await within(retry, 10_000);
        expect('handles' in got ? got.handles.map((h) => h.holdCount) : [(got as LockHandle).holdCount]).toEqual(keys.map(() => 1));
        for (const key of keys) expect(await app.locks.holdCount(key, { mode: options.mode })).toBe(1);
        await got.release();
      });
    } finally {
      subscription.unsubscribe();
    }
    for (const key of keys) expect(await app.locks.isLocked(key)).toBe(false);
    // The abandoned attempt emitted nothing: its grant never reached a caller.
    expect(events.sort()).toEqual(keys.flatMap((key) => [`acquired ${key}`, `released ${key}`]).sort());
  });

  it('a waiter handed the lock by a release Redis runs late, then retried by its owner, gets a fresh acquisition', async () => {
    const key = 'bound:retry-handover';
    const holder = await app.locks.acquire(key);
    await app.locks.run('bound:retry-outer', async () => {
      // Asleep on the key, in this process: the release takes it along (hands the lock to it in Redis).
      const waiting = app.locks.acquire(key, { waitMs: 1_000 }).catch((e: unknown) => e);
      await until(async () => asleep(app, key) === 1, 5_000, 'the waiter asleep');
      let retry: Promise<LockHandle>;
      redis.pause();
      try {
        const [release, wait] = await within(Promise.all([holder.release().catch((e: unknown) => e), waiting]), 5_000);
        expect(release).toBeInstanceOf(LockBackendError);
        expect(wait).toBeInstanceOf(LockBackendError);
        retry = app.locks.acquire(key, { waitMs: 10_000 });
      } finally {
        redis.resume();
      }
      const got = await within(retry, 10_000);
      expect(got.holdCount).toBe(1);
      expect(await app.locks.holdCount(key)).toBe(1);
      await got.release();
    });
    expect(await app.locks.isLocked(key)).toBe(false);
  });

  it.each<[string, { fair?: boolean; mode?: 'write' }, (key: string) => Promise<unknown>]>([
    // A waiting writer keeps new readers out of the key until its place lapses (fairQueueTimeoutMs, 5 s).
    ['a writer', { mode: 'write' }, (key) => app.locks.acquire(key, { mode: 'read' })],
    // A fair waiter's place comes before newcomers: the holder's release would hand it the lock.
    ['a fair waiter', { fair: true }, (key) => app.locks.acquire(key, { fair: true })],
  ])('%s whose first attempt Redis answers too late leaves the place that attempt took', async (_what, options, holder) => {
    const key = `bound:place-${options.fair ? 'fair' : 'write'}`;
    const held = (await holder(key)) as LockHandle;
    redis.pause();
    const failure = await within(app.locks.acquire(key, { ...options, waitMs: 0 }).catch((e: unknown) => e), 5_000).finally(() => redis.resume());
    expect(failure).toBeInstanceOf(LockBackendError);
    // Redis ran the attempt (refused: the key is held) and then the leave sent behind it, before
    // anything sent after them on this connection.
    if (options.mode === 'write') {
      const reader = await app.locks.acquire(key, { mode: 'read', waitMs: 0 });
      await reader.release();
    }
    await held.release();
    const left = (await redis.client().keys(`lock:{${key}}*`)).sort();
    expect(left).toEqual([`lock:{${key}}:fence`]);
  });

  it('a retry whose own bound passes while it waits for an abandoned attempt of its owner is never sent, and nothing stays held', async () => {
    const key = 'bound:retry-unsent';
    // Every acquisition script Redis runs on the key (only those name its fencing counter).
    const monitor = await redis.client().monitor();
    const attempts: string[] = [];
    const marker = new Promise<void>((resolve) =>
      monitor.on('monitor', (_time: string, args: string[]) => {
        if (args[0] === 'evalsha' && args.includes(`lock:{${key}}:fence`)) attempts.push(args[0]);
        if (args[0] === 'echo' && args[1] === 'marker') resolve();
      }),
    );
    try {
      await app.locks.run('bound:retry-outer', async () => {
        redis.pause();
        const failures = await within(
          (async () => {
            const first = await app.locks.acquire(key, { waitMs: 0 }).catch((e: unknown) => e);
            // The retry gives up too, Redis still frozen.
            return [first, await app.locks.acquire(key, { waitMs: 0 }).catch((e: unknown) => e)];
          })(),
          5_000,
        ).finally(() => redis.resume());
        for (const failure of failures) expect(failure).toBeInstanceOf(LockBackendError);
      });
      await until(async () => !(await app.locks.isLocked(key)), 5_000, 'the late grant was never given back');
      await redis.client().echo('marker');
      await within(marker, 5_000);
      expect(attempts).toHaveLength(1);
    } finally {
      monitor.disconnect();
    }
  });

  it('a longer bound: a Redis that stops answering for 1.5 s delays a release, and it still succeeds', async () => {
    const failed: unknown[] = [];
    const subscription = patient.locks.events$.subscribe((e) => e.type === 'release-failed' && failed.push(e));
    const released = nextEvent(patient.locks.events$, 'released', (e) => e.key === 'bound:long');
    try {
      const value = await within(
        patient.locks.run('bound:long', () => {
          redis.pause();
          // The outage's own length, not a wait for anything: Redis comes back after 1.5 s.
          setTimeout(() => redis.resume(), 1_500);
          return 'done';
        }),
        6_000,
      ).finally(() => redis.resume());
      expect(value).toBe('done');
      await released;
      expect(failed).toEqual([]);
      expect(patient.logger.at('error')).toEqual([]);
      expect(await patient.locks.isLocked('bound:long')).toBe(false);
    } finally {
      subscription.unsubscribe();
    }
  });
});
