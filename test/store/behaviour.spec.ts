import { AsyncResource } from 'node:async_hooks';
import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Injectable, Module } from '@nestjs/common';
import { Test, type TestingModule } from '@nestjs/testing';
import { performance } from 'node:perf_hooks';
import { filter } from 'rxjs';
import { Locked, LOCK_MODULE_OPTIONS, LockConfigurationError, LockModule, LockNotAcquiredError, LockService, LockTestingModule, LockUpgradeError, LockLostError, type LockModuleOptions } from '../../lib/index.js';
import { RedisCluster } from '../support/redis-cluster.js';
import { RedisServer } from '../support/redis-server.js';
import { aborted, CapturingLogger, gate, nextEvent, nextEvents, startLockApp, type LockApp } from '../support/lock-testing.js';

/**
 * The same behaviour, through the public API only, on every topology: one Redis server, a
 * 3-master Redis Cluster, the Redlock quorum over 3 independent servers, and the in-process memory
 * store. They cannot drift apart without this suite failing. Where Redlock differs on purpose (no
 * fencing tokens, no fair mode), the test says so and checks the refusal instead.
 */
describe.each(['redis', 'cluster', 'redlock', 'memory'] as const)('behaviour on the %s store', (store) => {
  let redis: RedisServer | undefined;
  let cluster: RedisCluster | undefined;
  let masters: RedisServer[] = [];
  let app: LockApp;
  const outside = new AsyncResource('another-context');
  const elsewhere = <T>(fn: () => Promise<T>) => outside.runInAsyncScope(fn);
  const start = async (options: LockModuleOptions) => {
    if (store === 'redis') return startLockApp({ ...options, redis: redis!.url });
    if (store === 'cluster') return startLockApp({ ...options, redis: { cluster: cluster!.nodes } });
    if (store === 'redlock') return startLockApp({ ...options, redlock: { clients: masters.map((m) => m.url) } });
    return startLockApp({ ...options, store: 'memory' });
  };

  beforeAll(async () => {
    if (store === 'redis') redis = await RedisServer.start();
    if (store === 'cluster') cluster = await RedisCluster.start();
    if (store === 'redlock') masters = await Promise.all([0, 1, 2].map(() => RedisServer.start()));
    app = await start({ leaseMs: 600, waitMs: 5_000, fairQueueTimeoutMs: 1_000 });
  });
  afterAll(async () => {
    await app?.close();
    await redis?.stop();
    await cluster?.stop();
    await Promise.all(masters.map((m) => m.stop()));
  });

  it('keeps a non-atomic counter exact under 8 contending contexts', async () => {
    let counter = 0;
    await Promise.all(
      Array.from({ length: 8 }, async () => {
        for (let i = 0; i < 25; i++) {
          await app.locks.run('b:counter', async () => {
            const value = counter;
            await new Promise((r) => setImmediate(r));
            counter = value + 1;
          });
        }
      }),
    );
    expect(counter).toBe(200);
  });

  it('re-enters in one context, keeps other contexts out, and frees only at the outer release', async () => {
    const otherGets = () => elsewhere(async () => { const h = await app.locks.tryAcquire('b:re'); await h?.release(); return h !== null; });
    await app.locks.run('b:re', async (outer) => {
      await app.locks.run('b:re', async (inner) => {
        expect(inner.holdCount).toBe(2);
        if (store !== 'redlock') expect(inner.fencingToken).toBe(outer.fencingToken);
        expect(await app.locks.holdCount('b:re')).toBe(2);
        expect(await otherGets()).toBe(false);
      });
      expect(await otherGets()).toBe(false);
    });
    expect(await app.locks.isLocked('b:re')).toBe(false);
    expect(await otherGets()).toBe(true);
  });

  it('re-enters through a shared owner token', async () => {
    const a = await app.locks.acquire('b:token', { owner: 'job-1' });
    const b = await app.locks.acquire('b:token', { owner: 'job-1', waitMs: 0 });
    expect(b.holdCount).toBe(2);
    expect(await app.locks.tryAcquire('b:token', { owner: 'job-2' })).toBeNull();
    await a.release();
    await b.release();
    expect(await app.locks.isLocked('b:token')).toBe(false);
  });

  it('ends a fixed lease and lets the next owner in', async () => {
    const lock = await app.locks.acquire('b:fixed', { leaseMs: 200 });
    expect(((await aborted(lock.signal)) as LockLostError).reason).toBe('lease-expired');
    const next = await app.locks.acquire('b:fixed', { waitMs: 0 });
    if (store !== 'redlock') expect(next.fencingToken).toBeGreaterThan(lock.fencingToken);
    await next.release();
  });

  it('keeps a watchdog lock for more than 3 leases', async () => {
    const started = performance.now();
    // This lock's renewals only: a lock an earlier failed test left held would count too.
    const renewed = nextEvents(app.locks.events$.pipe(filter((e) => e.key === 'b:watch')), 'renewed', 10, 10_000);
    const lock = await app.locks.acquire('b:watch');
    await renewed;
    expect(performance.now() - started).toBeGreaterThan(3 * 600);
    expect(lock.isHeld).toBe(true);
    expect(await app.locks.tryAcquire('b:watch', { owner: 'intruder' })).toBeNull();
    await lock.release();
  });

  it('wakes a waiter on the release, not on the lease, and says retryAfterMs when contended and when it times out', async () => {
    const holder = await app.locks.acquire('b:wait', { leaseMs: 30_000 });
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === 'b:wait');
    const waiting = app.locks.acquire('b:wait', { waitMs: 20_000 });
    waiting.catch(() => undefined); // awaited below; handled here, so that a failure before that is this test's own
    // Its contended event says when to try again: the holder's lease left.
    const { retryAfterMs } = await contended;
    expect(retryAfterMs).toBeGreaterThan(29_000);
    expect(retryAfterMs).toBeLessThanOrEqual(30_000);
    const releasedAt = performance.now();
    await holder.release();
    await (await waiting).release();
    expect(performance.now() - releasedAt).toBeLessThan(1_000);
    const other = await app.locks.acquire('b:wait2', { leaseMs: 5_000 });
    const failure = (await app.locks.acquire('b:wait2', { waitMs: 100 }).catch((e: unknown) => e)) as LockNotAcquiredError;
    expect(failure.reason).toBe('timeout');
    expect(failure.retryAfterMs).toBeGreaterThan(4_000);
    await other.release();
  });

  it('stops an aborted wait at once', async () => {
    const holder = await app.locks.acquire('b:abort');
    const controller = new AbortController();
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === 'b:abort');
    const waiting = app.locks.acquire('b:abort', { waitMs: 20_000, signal: controller.signal });
    await contended;
    controller.abort(new Error('stop'));
    await expect(waiting).rejects.toThrow('stop');
    await holder.release();
  });

  it('serves fair waiters in arrival order (Redlock: refuses fair mode)', async () => {
    if (store === 'redlock') {
      await expect(app.locks.acquire('b:fair', { fair: true })).rejects.toThrow(LockConfigurationError);
      await expect(app.locks.acquire('b:fair', { fair: true })).rejects.toThrow('fair mode keeps its queue on one Redis');
      expect(await app.locks.isLocked('b:fair')).toBe(false);
      return;
    }
    const seen = new Set<string>();
    const holder = await app.locks.acquire('b:fair', { fair: true });
    const order: number[] = [];
    const waiters: Promise<unknown>[] = [];
    for (let i = 0; i < 5; i++) {
      const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === 'b:fair' && e.owner !== holder.owner && !seen.has(e.owner));
      waiters.push(app.locks.run('b:fair', async () => void order.push(i), { fair: true, waitMs: 20_000 }));
      seen.add((await contended).owner);
    }
    await holder.release();
    await Promise.all(waiters);
    expect(order).toEqual([0, 1, 2, 3, 4]);
  });

  it('issues increasing fencing tokens (Redlock: refuses to, with a typed error)', async () => {
    if (store === 'redlock') {
      await app.locks.run('b:fence', async (l) => {
        expect(() => l.fencingToken).toThrow(LockConfigurationError);
        expect(() => l.fencingToken).toThrow('counters on independent masters cannot be made monotonic');
      });
      return;
    }
    const tokens: number[] = [];
    for (let i = 0; i < 50; i++) await app.locks.run('b:fence', async (l) => void tokens.push(l.fencingToken));
    for (let i = 1; i < tokens.length; i++) expect(tokens[i]).toBeGreaterThan(tokens[i - 1]!);
  });

  it('lets readers share, keeps the writer exclusive, downgrades, refuses upgrades, and does not starve writers', async () => {
    const r1 = await app.locks.readLock('b:rw');
    const r2 = await elsewhere(() => app.locks.readLock('b:rw'));
    expect(await elsewhere(() => app.locks.tryAcquire('b:rw', { mode: 'write' }))).toBeNull();
    await r1.run(() => expect(app.locks.writeLock('b:rw')).rejects.toBeInstanceOf(LockUpgradeError));
    const writer = elsewhere(() => app.locks.writeLock('b:rw', { waitMs: 5_000 }));
    await nextEvent(app.locks.events$, 'contended', (e) => e.key === 'b:rw');
    // A writer waits: a new reader is refused, while the readers inside may leave.
    expect(await elsewhere(() => app.locks.tryAcquire('b:rw', { mode: 'read' }))).toBeNull();
    await r1.release();
    await r2.release();
    const w = await writer;
    const down = await w.run(() => app.locks.readLock('b:rw'));
    expect(down.holdCount).toBe(1);
    await w.release();
    expect(await elsewhere(() => app.locks.tryAcquire('b:rw', { mode: 'write' }))).toBeNull();
    const reader = await elsewhere(() => app.locks.readLock('b:rw', { waitMs: 0 }));
    await reader.release();
    await down.release();
    expect(await app.locks.isLocked('b:rw')).toBe(false);
  });

  it('takes multi-key groups all or nothing, in canonical order, without deadlock', async () => {
    const blocker = await elsewhere(() => app.locks.acquire('b:m3'));
    await expect(app.locks.acquire(['b:m1', 'b:m2', 'b:m3'], { waitMs: 0 })).rejects.toBeInstanceOf(LockNotAcquiredError);
    expect(await app.locks.isLocked('b:m1')).toBe(false);
    await blocker.release();
    let balanceA = 100;
    let balanceB = 100;
    await Promise.all(
      Array.from({ length: 20 }, (_, i) =>
        app.locks.run(i % 2 ? ['b:A', 'b:B'] : ['b:B', 'b:A'], async (group) => {
          expect(group.keys).toEqual(['b:A', 'b:B']);
          const [a, b] = [balanceA, balanceB];
          await new Promise((r) => setImmediate(r));
          [balanceA, balanceB] = i % 2 ? [a - 1, b + 1] : [a + 1, b - 1];
        }),
      ),
    );
    expect(balanceA + balanceB).toBe(200);
    expect(balanceA).toBe(100);
  });

  it('releases a lock and a multi-key group held with `await using` when the block ends, even when it throws', async () => {
    const held = async (): Promise<boolean[]> => Promise.all(['b:using', 'b:using:1', 'b:using:2'].map((key) => app.locks.isLocked(key)));
    {
      await using lock = await app.locks.acquire('b:using');
      await using group = await app.locks.acquire(['b:using:1', 'b:using:2']);
      expect([lock.isHeld, group.isHeld]).toEqual([true, true]);
      expect(await held()).toEqual([true, true, true]);
    }
    expect(await held()).toEqual([false, false, false]);
    await expect(
      (async () => {
        await using lock = await app.locks.acquire('b:using');
        expect(lock.isHeld).toBe(true);
        throw new Error('the work failed');
      })(),
    ).rejects.toThrow('the work failed');
    // Free for another owner at once, not only once its lease ends.
    const next = await app.locks.tryAcquire('b:using');
    expect(next).not.toBeNull();
    await next!.release();
  });

  it('aborts a holder\'s signal when its lock is force-unlocked', async () => {
    const lock = await app.locks.acquire('b:force');
    expect(await app.locks.forceUnlock('b:force')).toBe(true);
    expect(((await aborted(lock.signal)) as LockLostError).reason).toBe('taken');
    expect(await app.locks.forceUnlock('b:force')).toBe(false);
  });

  it('aborts a signal first read after the loss, or inside the lost event, with the loss', async () => {
    // A lock's AbortController is created when its signal is first read: neither handle's
    // signal is touched before its lock is lost.
    const later = await app.locks.acquire('b:late-signal');
    const during = await app.locks.acquire('b:event-signal');
    const seen = new Promise<unknown>((resolve) => {
      const subscription = app.locks.events$.subscribe((e) => {
        if (e.type === 'lost' && e.key === 'b:event-signal') {
          subscription.unsubscribe();
          resolve(during.signal.aborted ? during.signal.reason : 'not aborted');
        }
      });
    });
    await app.locks.forceUnlock('b:event-signal');
    const inEvent = await seen;
    expect(inEvent).toBeInstanceOf(LockLostError);
    expect(during.signal.reason).toBe(inEvent);
    await app.locks.forceUnlock('b:late-signal');
    expect(later.signal.aborted).toBe(true);
    expect((later.signal.reason as LockLostError).reason).toBe('taken');
    await expect(later.extend(1_000)).rejects.toBe(later.signal.reason);
  });
});

describe('LockTestingModule', () => {
  it("puts an application module's LockModule.forRoot() or forRootAsync() on the memory store with overrideProvider(LOCK_MODULE_OPTIONS)", async () => {
    @Injectable()
    class Payments {
      constructor(readonly locks: LockService) {}
      @Locked('payment:<0>')
      async pay(id: string) {
        return { id, holdCount: this.locks.current()?.holdCount, held: await this.locks.isLocked(`payment:${id}`) };
      }
    }
    // Both point at a port where no Redis listens: bootstrap would fail after 1 s without the override.
    @Module({ imports: [LockModule.forRoot({ redis: 'redis://127.0.0.1:1', connectTimeoutMs: 1_000, isGlobal: true })], providers: [Payments] })
    class AppModule {}
    @Module({ imports: [LockModule.forRootAsync({ useFactory: async () => ({ redis: 'redis://127.0.0.1:1', connectTimeoutMs: 1_000 }), isGlobal: true })], providers: [Payments] })
    class AsyncAppModule {}
    for (const root of [AppModule, AsyncAppModule]) {
      const moduleRef = await Test.createTestingModule({ imports: [root] })
        .overrideProvider(LOCK_MODULE_OPTIONS)
        .useValue({ store: 'memory' })
        .setLogger(new CapturingLogger())
        .compile();
      await moduleRef.init();
      expect(await moduleRef.get(Payments).pay('7')).toEqual({ id: '7', holdCount: 1, held: true });
      expect((await moduleRef.get(LockService).health()).store).toMatch(/memory/);
      await moduleRef.close();
    }
  });

  it("warns when imported twice in one application: the two memory stores' locks never exclude each other", async () => {
    @Injectable()
    class Holder {
      constructor(readonly locks: LockService) {}
    }
    @Module({ imports: [LockTestingModule.forRoot()], providers: [Holder], exports: [Holder] })
    class FirstModule {}
    @Module({ imports: [FirstModule, LockTestingModule.forRoot()], providers: [{ provide: 'second', useFactory: (locks: LockService) => locks, inject: [LockService] }] })
    class SecondModule {}
    const logger = new CapturingLogger();
    const moduleRef = await Test.createTestingModule({ imports: [SecondModule] }).setLogger(logger).compile();
    await moduleRef.init();
    expect(logger.at('warn')).toEqual([expect.stringMatching(/^LockModule\.forRoot\(\) is imported 2 times in this application.*on the memory store, its own locks, which never exclude another import's/)]);
    const first = moduleRef.get(Holder).locks;
    const second = moduleRef.get<LockService>('second');
    expect(first).not.toBe(second);
    const held = await first.acquire('twice');
    const alsoHeld = await second.tryAcquire('twice');
    expect(alsoHeld).not.toBeNull(); // what the warning is about
    await alsoHeld!.release();
    await held.release();
    await moduleRef.close();
  });

  it('gives @Locked and LockService an in-process store without any Redis', async () => {
    @Injectable()
    class Orders {
      constructor(readonly locks: LockService) {}
      @Locked('order:<0>')
      async pay(id: string) {
        return this.locks.current()?.key;
      }
    }
    const moduleRef: TestingModule = await Test.createTestingModule({ imports: [LockTestingModule.forRoot({ isGlobal: true })], providers: [Orders] })
      .setLogger(new CapturingLogger())
      .compile();
    await moduleRef.init();
    const entered = gate();
    const release = gate();
    const locks = moduleRef.get(LockService);
    const first = locks.run('order:1', async () => {
      entered.open();
      await release.promise;
    });
    await entered.promise;
    expect(await locks.isLocked('order:1')).toBe(true);
    const second = moduleRef.get(Orders).pay('1');
    await nextEvent(locks.events$, 'contended', (e) => e.key === 'order:1');
    release.open();
    await first;
    expect(await second).toBe('order:1');
    await moduleRef.close();
  });
});
