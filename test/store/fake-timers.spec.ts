import { afterAll, afterEach, beforeAll, beforeEach, describe, expect, it, jest } from '@jest/globals';
import { Injectable } from '@nestjs/common';
import { Cron, ScheduleModule } from '@nestjs/schedule';
import { Test, type TestingModule } from '@nestjs/testing';
import { filter, type Subscription } from 'rxjs';
import { Locked, LockBackendError, LockLostError, LockNotAcquiredError, LockService, LockTestingModule, type LockEvent, type LockLostEvent, type LockReleasedEvent } from '../../lib/index.js';
import { bootstrapFailure, CapturingLogger, elsewhere, nextEvents, startLockApp, type LockApp } from '../support/lock-testing.js';
import { RedisServer, replicaAcknowledges, until } from '../support/redis-server.js';

/**
 * LockTestingModule under Jest's fake timers, the way apps test their scheduled jobs: the memory
 * store's leases, `minHoldMs`, waits and renewals all follow the fake clock, as the timers that wait
 * for them do. (The Redis stores keep real time, clock and timers: Redis's leases run on real time.)
 */
const ticks: { instance: string; at: string }[] = [];

/** Two instances of one job, as two app instances would run it: one key, both triggered every 10 s. */
@Injectable()
class ReportJobA {
  @Cron('*/10 * * * * *')
  @Locked('jobs:report', { onContention: 'skip', minHoldMs: 8_000 })
  async run() {
    ticks.push({ instance: 'A', at: new Date().toISOString() });
  }
}
@Injectable()
class ReportJobB {
  @Locked('jobs:report', { onContention: 'skip', minHoldMs: 8_000 })
  @Cron('*/10 * * * * *')
  async run() {
    ticks.push({ instance: 'B', at: new Date().toISOString() });
  }
}

describe("LockTestingModule under Jest's fake timers", () => {
  let moduleRef: TestingModule;
  let locks: LockService;
  const events: LockEvent[] = [];
  let watching: Subscription;
  beforeEach(async () => {
    jest.useFakeTimers({ now: new Date('2026-01-01T00:00:00.000Z') });
    ticks.length = 0;
    events.length = 0;
    moduleRef = await Test.createTestingModule({ imports: [ScheduleModule.forRoot(), LockTestingModule.forRoot()], providers: [ReportJobA, ReportJobB] })
      .setLogger(new CapturingLogger())
      .compile();
    await moduleRef.init();
    locks = moduleRef.get(LockService);
    watching = locks.events$.subscribe((e) => events.push(e));
  });
  afterEach(async () => {
    watching.unsubscribe();
    await moduleRef.close();
    jest.useRealTimers();
  });

  it('runs a @Cron job with onContention skip and minHoldMs once per tick: minHoldMs ends on the fake clock', async () => {
    await jest.advanceTimersByTimeAsync(40_000);
    const at = ticks.map((t) => t.at);
    expect(at).toEqual(['2026-01-01T00:00:10.000Z', '2026-01-01T00:00:20.000Z', '2026-01-01T00:00:30.000Z', '2026-01-01T00:00:40.000Z']);
    expect(events.filter((e) => e.type === 'skipped')).toHaveLength(4);
  });

  it('keeps a watchdog lock held for far longer than its lease, renewed every third of it on the fake clock', async () => {
    const lock = await locks.acquire('held', { leaseMs: 3_000, watchdog: true });
    await jest.advanceTimersByTimeAsync(60_000);
    // Every 1 s of the 3 s lease: 60 renewals in 60 s.
    expect(events.filter((e) => e.type === 'renewed' && e.key === 'held')).toHaveLength(60);
    expect(lock.isHeld).toBe(true);
    expect(await elsewhere(() => locks.tryAcquire('held'))).toBeNull();
    await lock.release();
    expect(lock.isHeld).toBe(false);
  });

  it('loses a watchdog lock when the synchronous advanceTimersByTime() jumps past its lease: no renewal could settle meanwhile', async () => {
    const lock = await locks.acquire('jumped', { leaseMs: 3_000, watchdog: true });
    jest.advanceTimersByTime(10_000);
    await jest.advanceTimersByTimeAsync(0); // let the promises of that jump settle
    expect(lock.isHeld).toBe(false);
    expect((lock.signal.reason as LockLostError).reason).toBe('lease-expired');
    expect(events).toContainEqual(expect.objectContaining({ type: 'lost', key: 'jumped', reason: 'lease-expired' }));
  });

  it('ends a wait after waitMs of fake time with LockNotAcquiredError and a timed-out event', async () => {
    const holder = await locks.acquire('waited');
    let outcome: unknown;
    const waiting = elsewhere(() => locks.acquire('waited', { waitMs: 2_000 })).then(
      () => 'acquired',
      (error: unknown) => (outcome = error),
    );
    await jest.advanceTimersByTimeAsync(1_900);
    expect(outcome).toBeUndefined();
    await jest.advanceTimersByTimeAsync(200);
    await waiting;
    expect(outcome).toBeInstanceOf(LockNotAcquiredError);
    expect((outcome as LockNotAcquiredError).reason).toBe('timeout');
    // Its timed-out event says how long it waited, as the error does: waitMs of fake time.
    const waitedMs = (outcome as LockNotAcquiredError).waitedMs;
    expect(waitedMs).toBeGreaterThanOrEqual(2_000);
    expect(waitedMs).toBeLessThan(2_100);
    expect(events.filter((e) => e.type === 'timed-out')).toEqual([{ type: 'timed-out', key: 'waited', owner: expect.any(String), waitedMs }]);
    await holder.release();
  });

  it('ends a fixed lease after leaseMs of fake time: the holder is told, another owner takes the key', async () => {
    const lock = await locks.acquire('fixed', { leaseMs: 5_000 });
    const lost = new Promise<LockLostEvent>((resolve) => locks.events$.pipe(filter((e): e is LockLostEvent => e.type === 'lost' && e.key === 'fixed')).subscribe(resolve));
    await jest.advanceTimersByTimeAsync(4_900);
    expect(lock.isHeld).toBe(true);
    await jest.advanceTimersByTimeAsync(200);
    const event = await lost;
    expect(event).toMatchObject({ reason: 'lease-expired' });
    // Held from its grant to its lease's end, on the fake clock: the event and the error say so.
    expect(event.heldMs).toBeGreaterThan(4_900);
    expect(event.heldMs).toBeLessThan(5_100);
    const error = lock.signal.reason as LockLostError;
    expect(error).toMatchObject({ reason: 'lease-expired', heldMs: event.heldMs });
    expect(error.message).toMatch(/^Lock "fixed" was lost after (49|50)\d\d ms: /);
    const next = await elsewhere(() => locks.tryAcquire('fixed'));
    expect(next).not.toBeNull();
    await next!.release();
  });

  it('reports how long an acquisition waited, and how long a lock was held, on the fake clock', async () => {
    const holder = await locks.acquire('waited-for');
    const waiting = elsewhere(() => locks.acquire('waited-for', { waitMs: 60_000 }));
    await jest.advanceTimersByTimeAsync(1_500);
    await holder.release();
    const lock = await waiting;
    const acquired = events.filter((e) => e.type === 'acquired' && e.key === 'waited-for');
    expect(acquired).toHaveLength(2);
    expect(acquired[0]).toMatchObject({ waitedMs: 0 });
    expect(acquired[1]).toMatchObject({ owner: lock.owner });
    expect((acquired[1] as { waitedMs: number }).waitedMs).toBeGreaterThanOrEqual(1_500);
    expect((acquired[1] as { waitedMs: number }).waitedMs).toBeLessThan(2_000);
    await jest.advanceTimersByTimeAsync(700);
    await lock.release();
    const released = events.filter((e): e is LockReleasedEvent => e.type === 'released' && e.key === 'waited-for');
    expect(released.map((e) => e.owner)).toEqual([holder.owner, lock.owner]);
    expect(released[0]!.heldMs).toBeGreaterThanOrEqual(1_500);
    expect(released[0]!.heldMs).toBeLessThan(2_000);
    expect(released[1]!.heldMs).toBeGreaterThanOrEqual(700);
    expect(released[1]!.heldMs).toBeLessThan(1_000);
  });

  it('keeps the longer fixed lease when a re-entry asks for a shorter one', async () => {
    await locks.run('re-entered', async (outer) => {
      const inner = await locks.acquire('re-entered', { leaseMs: 1_000 });
      expect(inner.holdCount).toBe(2);
      await inner.release();
      await jest.advanceTimersByTimeAsync(3_000);
      expect(outer.isHeld).toBe(true);
      expect(events.filter((e) => e.type === 'lost')).toEqual([]);
      expect(await locks.tryAcquire('re-entered', { owner: 'someone-else' })).toBeNull();
    }, { leaseMs: 5_000 });
  });

  it('tells the holder when a lease shortened by extend() ends, without the holder reading its handle', async () => {
    const lock = await locks.acquire('shortened', { leaseMs: 60_000 });
    await lock.extend(2_000);
    await jest.advanceTimersByTimeAsync(2_500);
    // Found by the watchdog's timer, brought forward to the new deadline (not the 60 s one).
    expect(events.filter((e) => e.type === 'lost' && e.key === 'shortened')).toEqual([expect.objectContaining({ reason: 'lease-expired' })]);
    const next = await elsewhere(() => locks.tryAcquire('shortened'));
    expect(next).not.toBeNull();
    await next!.release();
  });

  it("takes the module's watchdog: false as every lock's default: a lock taken without a lease of its own ends after the module's leaseMs", async () => {
    const fixed = await Test.createTestingModule({ imports: [LockTestingModule.forRoot({ watchdog: false, leaseMs: 3_000 })] })
      .setLogger(new CapturingLogger())
      .compile();
    await fixed.init();
    try {
      const service = fixed.get(LockService);
      const seen: LockEvent[] = [];
      const watchingFixed = service.events$.subscribe((e) => seen.push(e));
      const bare = await service.acquire('module-fixed:bare');
      const withOptions = await service.acquire('module-fixed:options', { waitMs: 0 });
      const renewing = await service.acquire('module-fixed:renewing', { watchdog: true });
      await jest.advanceTimersByTimeAsync(3_500);
      watchingFixed.unsubscribe();
      expect(seen.filter((e) => e.type === 'lost').map((e) => e.key).sort()).toEqual(['module-fixed:bare', 'module-fixed:options']);
      expect(seen.filter((e) => e.type === 'renewed').map((e) => e.key)).toEqual(['module-fixed:renewing', 'module-fixed:renewing', 'module-fixed:renewing']);
      expect([bare.isHeld, withOptions.isHeld, renewing.isHeld]).toEqual([false, false, true]);
      await renewing.release();
    } finally {
      await fixed.close();
    }
  });

  it('reports no loss for a handle read after its release, once its lease would have ended', async () => {
    const lock = await locks.acquire('released-then-read', { leaseMs: 1_000 });
    await lock.release();
    await jest.advanceTimersByTimeAsync(2_000);
    expect(lock.signal.aborted).toBe(false);
    expect(lock.isHeld).toBe(false);
    expect(events.filter((e) => e.type === 'lost')).toEqual([]);
  });
});

describe("LockModule on Redis under Jest's fake timers", () => {
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
  afterEach(() => {
    jest.useRealTimers();
  });

  it("keeps its deadlines on the real clock: fake time past a lease loses nothing, as Redis's lease runs on real time", async () => {
    jest.useFakeTimers();
    const lock = await app.locks.acquire('redis:held', { leaseMs: 3_000, watchdog: true });
    await jest.advanceTimersByTimeAsync(10_000);
    expect(lock.isHeld).toBe(true);
    expect(await app.locks.remainingTtl('redis:held')).toBeGreaterThan(0);
    await lock.release();
    expect(await app.locks.isLocked('redis:held')).toBe(false);
  });
  it('renews a watchdog lock on real time while the test does not advance fake time', async () => {
    jest.useFakeTimers();
    const lock = await app.locks.acquire('redis:real-renewal', { leaseMs: 1_000, watchdog: true });
    await nextEvents(app.locks.events$.pipe(filter((e) => e.key === 'redis:real-renewal')), 'renewed', 3, 5_000);
    expect(lock.isHeld).toBe(true);
    await lock.release();
  }, 10_000);

  it('ends a wait after waitMs of real time while the test does not advance fake time', async () => {
    jest.useFakeTimers();
    const holder = await app.locks.acquire('redis:real-wait');
    const outcome = await elsewhere(() => app.locks.acquire('redis:real-wait', { waitMs: 300 })).catch((e: unknown) => e);
    expect(outcome).toBeInstanceOf(LockNotAcquiredError);
    await holder.release();
  }, 10_000);
  it("bounds its steps on real time: fake time jumping past the 1 s bound while a release is in flight fails nothing", async () => {
    const raw = redis.shared();
    await raw.ping(); // connected before the timers are faked: ioredis's own connect waits on timers
    jest.useFakeTimers();
    const lock = await app.locks.acquire('redis:bounded');
    const releasing = lock.release();
    jest.advanceTimersByTime(5_000); // the release's reply is still to be read
    await releasing;
    expect(await raw.exists('lock:{redis:bounded}')).toBe(0);
  }, 10_000);
  it('fails a bootstrap under fake timers after connectTimeoutMs of real time: ioredis waits for the faked process.nextTick to connect', async () => {
    jest.useFakeTimers();
    // Real timers again before an app that starts by mistake is closed: its QUIT fallback is a timer.
    const started = await bootstrapFailure(() => startLockApp({ redis: redis.url, connectTimeoutMs: 1_000 }).finally(() => jest.useRealTimers()));
    expect(started).toBeInstanceOf(LockBackendError);
    expect((started as LockBackendError).message).toContain('no answer');
  }, 10_000);

  it('confirms with replicas (replication) under fake timers installed after bootstrap: its WAIT batching keeps the real process.nextTick', async () => {
    const replica = await RedisServer.start(['--replicaof', '127.0.0.1', String(redis.port)]);
    const confirming = await startLockApp({ redis: redis.url, replication: { replicas: 1, timeoutMs: 2_000 } }).catch(async (error: unknown) => {
      await replica.stop();
      throw error;
    });
    try {
      await until(() => replicaAcknowledges(redis.shared()), 10_000, 'the replica never acknowledged a write');
      // Connected before the timers are faked: ioredis connects on process.nextTick.
      const onReplica = replica.client();
      await onReplica.ping();
      jest.useFakeTimers();
      const lock = await confirming.locks.acquire('redis:confirmed');
      // Confirmed: the replica has the lock when acquire() returns, and has its release when release() does.
      expect(await onReplica.hget('lock:{redis:confirmed}', lock.owner)).toBe('1');
      await lock.release();
      expect(await onReplica.exists('lock:{redis:confirmed}')).toBe(0);
    } finally {
      jest.useRealTimers();
      await confirming.close();
      await replica.stop();
    }
  }, 20_000);

  it("bootstraps and locks under fake timers that leave process.nextTick real (doNotFake: ['nextTick'])", async () => {
    jest.useFakeTimers({ doNotFake: ['nextTick'] });
    const other = await startLockApp({ redis: redis.url, connectTimeoutMs: 1_000 });
    try {
      const lock = await other.locks.acquire('redis:booted');
      expect(await elsewhere(() => app.locks.tryAcquire('redis:booted'))).toBeNull();
      await lock.release();
    } finally {
      await other.close();
    }
  }, 10_000);
});
