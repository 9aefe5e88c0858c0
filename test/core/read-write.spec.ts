import { AsyncResource } from 'node:async_hooks';
import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Injectable, Module } from '@nestjs/common';
import { Test } from '@nestjs/testing';
import type { Redis } from 'ioredis';
import { performance } from 'node:perf_hooks';
import { Locked, LockModule, LockNotAcquiredError, LockService, LockUpgradeError, type LockLostError } from '../../lib/index.js';
import type { LockStore } from '../../lib/store/lock-store.js';
import { Fixture } from '../support/children.js';
import { RedisServer, redisNowMs, until } from '../support/redis-server.js';
import { aborted, asleep, CapturingLogger, gate, nextEvent, nextEvents, startLockApp, usePrivateLockApp, within, type LockApp } from '../support/lock-testing.js';

describe('read-write locks', () => {
  let redis: RedisServer;
  let raw: Redis;
  let app: LockApp;
  usePrivateLockApp({ waitMs: 5_000, leaseMs: 600, fairQueueTimeoutMs: 1_000 }, (started) => ({ redis, raw, app } = started));

  // Another context, even when called from inside a run() callback.
  const outside = new AsyncResource('another-context');
  const elsewhere = <T>(fn: () => Promise<T>) => outside.runInAsyncScope(fn);
  const canRead = (key: string) => elsewhere(async () => { const h = await app.locks.tryAcquire(key, { mode: 'read' }); await h?.release(); return h !== null; });
  const canWrite = (key: string) => elsewhere(async () => { const h = await app.locks.tryAcquire(key, { mode: 'write' }); await h?.release(); return h !== null; });

  it('lets many readers in at once and keeps the writer out until the last one leaves', async () => {
    const a = await app.locks.readLock('rw:1');
    const b = await app.locks.readLock('rw:1');
    expect(await raw.hgetall('lock:{rw:1}')).toEqual({ ':mode': 'read', [`${a.owner}:read`]: '1', [`${b.owner}:read`]: '1' });
    expect(await canWrite('rw:1')).toBe(false);
    expect(await app.locks.tryAcquire('rw:1')).toBeNull(); // a plain exclusive lock is kept out too
    await a.release();
    expect(await canWrite('rw:1')).toBe(false);
    await b.release();
    expect(await raw.exists('lock:{rw:1}')).toBe(0);
    expect(await canWrite('rw:1')).toBe(true);
  });

  it('keeps readers and other writers out while a writer holds the lock', async () => {
    const w = await app.locks.writeLock('rw:2');
    expect(await canRead('rw:2')).toBe(false);
    expect(await canWrite('rw:2')).toBe(false);
    await w.release();
    expect(await canRead('rw:2')).toBe(true);
  });

  it('is reentrant on both sides, and lets a writer read (downgrade)', async () => {
    await app.locks.run('rw:3', async (outer) => {
      const again = await app.locks.writeLock('rw:3');
      expect(again.holdCount).toBe(2);
      const read = await app.locks.readLock('rw:3'); // downgrade
      expect(read.holdCount).toBe(1);
      expect([outer.mode, again.mode, read.mode]).toEqual(['write', 'write', 'read']);
      expect(app.locks.current('rw:3')!.mode).toBe('write');
      expect(read.run(() => app.locks.current('rw:3')!.mode)).toBe('read'); // the innermost hold on the key
      expect(await canRead('rw:3')).toBe(false); // still a writer inside
      await again.release();
      expect(outer.isHeld).toBe(true);
      await read.release();
    }, { mode: 'write' });
    await app.locks.run('rw:3', async () => {
      const nested = await app.locks.readLock('rw:3');
      expect(nested.holdCount).toBe(2);
      expect(await canRead('rw:3')).toBe(true);
      await nested.release();
    }, { mode: 'read' });
    expect(await raw.exists('lock:{rw:3}')).toBe(0);
  });

  it('turns a writer that keeps a read hold into a reader when it releases the write side', async () => {
    const w = await app.locks.writeLock('rw:4');
    const r = await w.run(() => app.locks.readLock('rw:4'));
    await w.release();
    expect(await raw.hget('lock:{rw:4}', ':mode')).toBe('read');
    expect(await canRead('rw:4')).toBe(true);
    expect(await canWrite('rw:4')).toBe(false);
    await r.release();
    expect(await raw.exists('lock:{rw:4}')).toBe(0);
  });

  it('refuses a reader\'s request for the write side at once, instead of deadlocking', async () => {
    await app.locks.run('rw:5', async () => {
      const started = performance.now();
      const refused = await app.locks.writeLock('rw:5', { waitMs: 10_000 }).catch((e: unknown) => e);
      expect(refused).toBeInstanceOf(LockUpgradeError);
      expect(String(refused)).toBe(
        'LockUpgradeError: Lock "rw:5": this owner holds the read lock and asked for the write lock. Upgrading is not supported ' +
          '(two readers upgrading at once would deadlock): release the read lock first, or take the write lock from the start (a writer may also read).',
      );
      // At once, not after the 10 s wait.
      expect(performance.now() - started).toBeLessThan(2_000);
    }, { mode: 'read' });
    expect(await raw.exists('lock:{rw:5}', 'lock:{rw:5}:writers')).toBe(0);
  });

  it('wakes every waiting reader when the writer releases', async () => {
    const w = await app.locks.writeLock('rw:6');
    const allInside = gate();
    let inside = 0;
    const contended = nextEvents(app.locks.events$, 'contended', 5);
    const readers = Array.from({ length: 5 }, () =>
      app.locks.run('rw:6', async () => {
        if (++inside === 5) allInside.open();
        await allInside.promise; // every reader holds the lock at the same time
      }, { mode: 'read' }),
    );
    await contended;
    await w.release();
    await Promise.all(readers);
    expect(inside).toBe(5);
  });

  /**
   * `n` readers of `app` wait for `key` (120 s waits) until all sleep; each, once in, holds the lock
   * until all `n` hold it at once. `allIn()` resolves when they all got in, and fails after 10 s: a
   * reader left asleep sleeps until the holder's 120 s lease ends, so only a wake gets it in sooner.
   */
  const sleepingReaders = async (key: string, n: number) => {
    const allInside = gate();
    let inside = 0;
    const readers = Promise.all(
      Array.from({ length: n }, () =>
        app.locks.run(key, async () => {
          if (++inside === n) allInside.open();
          await allInside.promise;
        }, { mode: 'read', waitMs: 120_000 }),
      ),
    );
    void readers.catch(() => undefined); // a test that fails before allIn() leaves them to shutdown
    // Asleep, not only refused once: a reader whose attempt is still in flight gets in without being woken.
    await until(async () => asleep(app, key) === n, 10_000, `the ${n} readers asleep`);
    return { allIn: () => within(readers, 10_000) };
  };

  it('wakes every waiting reader when the writer\'s application shuts down with the lock', async () => {
    // Shutdown takes back every hold at once (releaseAll), not one hold at a time (release).
    const writerApp = await startLockApp({ redis: redis.url });
    await writerApp.locks.writeLock('rw:13', { leaseMs: 120_000 });
    const readers = await sleepingReaders('rw:13', 5);
    await writerApp.close();
    await readers.allIn();
  });

  it('wakes every waiting reader when an operator force-unlocks a write lock', async () => {
    const writer = await elsewhere(() => app.locks.writeLock('rw:14', { leaseMs: 120_000 }));
    const readers = await sleepingReaders('rw:14', 3);
    expect(await app.locks.forceUnlock('rw:14')).toBe(true);
    await readers.allIn();
    expect(writer.isHeld).toBe(false);
  });

  it('wakes every waiting reader of a process when a plain exclusive lock is released: its message wakes one, who passes it on', async () => {
    // The holder in another application: its release wakes the readers here by its message only.
    const other = await startLockApp({ redis: redis.url });
    try {
      const holder = await other.locks.acquire('rw:15', { leaseMs: 120_000 });
      const readers = await sleepingReaders('rw:15', 3);
      await holder.release();
      await readers.allIn();
    } finally {
      await other.close();
    }
  });

  it('does not let a steady stream of readers starve a writer', async () => {
    let stop = false;
    let reads = 0;
    // Four readers that overlap all the time: there is never a moment without a reader.
    const readers = Array.from({ length: 4 }, (_, i) =>
      (async () => {
        await new Promise((r) => setTimeout(r, i * 5));
        while (!stop) {
          await app.locks.run('rw:7', async () => {
            reads++;
            await new Promise((r) => setTimeout(r, 20));
          }, { mode: 'read', waitMs: 10_000 });
        }
      })(),
    );
    await nextEvents(app.locks.events$, 'acquired', 8);
    const started = performance.now();
    const writer = await app.locks.writeLock('rw:7', { waitMs: 5_000 });
    const waited = performance.now() - started;
    const readsWhileWriting = reads;
    await new Promise((r) => setTimeout(r, 50));
    expect(reads).toBe(readsWhileWriting); // no reader got in while the writer held it
    await writer.release();
    stop = true;
    await Promise.all(readers);
    expect(waited).toBeLessThan(1_000);
  });

  it('keeps a waiting writer\'s place for fairQueueTimeoutMs, and for as long as it waits, behind a reader whose lease is 3 of those', async () => {
    // The place lasts fairQueueTimeoutMs (1 s here) from each attempt, and the writer comes back
    // every half of it, not at the end of the reader's 3 s lease: its place never lapses, so new
    // readers stay out past the first place's end.
    const r = await app.locks.readLock('rw:place', { leaseMs: 3_000, watchdog: true });
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === 'rw:place');
    const writing = elsewhere(() => app.locks.writeLock('rw:place', { waitMs: 10_000 }));
    try {
      const { owner } = await contended;
      const firstPlaceEnds = Number(await raw.zscore('lock:{rw:place}:writers', owner));
      expect(firstPlaceEnds - (await redisNowMs(raw))).toBeLessThanOrEqual(1_000);
      await until(async () => (await redisNowMs(raw)) > firstPlaceEnds + 100, 5_000, 'Redis\'s clock never passed the first place\'s end');
      expect(await canRead('rw:place')).toBe(false);
      expect(Number(await raw.zscore('lock:{rw:place}:writers', owner))).toBeGreaterThan(firstPlaceEnds);
    } finally {
      // Also when a check above failed: the writer's renewals must not reach the next test.
      await r.release();
      await (await writing).release();
    }
  });

  it('lets a writer take the read side of its own lock (downgrade) while another writer waits', async () => {
    const w = await app.locks.writeLock('rw:downgrade-waiting');
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === 'rw:downgrade-waiting');
    const other = elsewhere(() => app.locks.writeLock('rw:downgrade-waiting', { waitMs: 5_000 }));
    try {
      await contended;
      const read = await w.run(() => app.locks.readLock('rw:downgrade-waiting', { waitMs: 0 }));
      expect(read.holdCount).toBe(1);
      await read.release();
    } finally {
      await w.release();
      await (await other).release();
    }
  });

  it('takes a writer that waited out of the waiting writers when it gets the lock: readers get in right after its release', async () => {
    const r = await app.locks.readLock('rw:waited');
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === 'rw:waited');
    const writing = elsewhere(() => app.locks.writeLock('rw:waited', { waitMs: 5_000 }));
    await contended;
    await r.release();
    const w = await writing;
    try {
      expect(await raw.zcard('lock:{rw:waited}:writers')).toBe(0);
    } finally {
      await w.release();
    }
    expect(await canRead('rw:waited')).toBe(true);
  });

  it('gives a read lock the longest lease of its readers', async () => {
    const a = await app.locks.readLock('rw:ttl', { leaseMs: 1_000 });
    const first = await raw.pttl('lock:{rw:ttl}');
    expect(first).toBeGreaterThan(0);
    expect(first).toBeLessThanOrEqual(1_000);
    const b = await elsewhere(() => app.locks.readLock('rw:ttl', { leaseMs: 5_000 }));
    expect(await raw.pttl('lock:{rw:ttl}')).toBeGreaterThan(1_000);
    await a.release();
    await b.release();
  });

  it("keeps a reader's longer lease when another reader renews a shorter one and leaves: no writer gets in under it", async () => {
    // Before, the short reader's renewal set the whole lock's lease to its own 900 ms, and the lock
    // ended soon after it left, while the long reader held it (its next renewal only at 2 s).
    const short = await app.locks.readLock('rw:renewed', { leaseMs: 900, watchdog: true });
    const long = await elsewhere(() => app.locks.readLock('rw:renewed', { leaseMs: 6_000, watchdog: true }));
    await nextEvent(app.locks.events$, 'renewed', (e) => e.key === 'rw:renewed' && e.owner === short.owner);
    expect(await raw.pttl('lock:{rw:renewed}')).toBeGreaterThan(900);
    await short.release();
    try {
      await expect(elsewhere(() => app.locks.writeLock('rw:renewed', { waitMs: 1_500 }))).rejects.toBeInstanceOf(LockNotAcquiredError);
      expect(long.isHeld).toBe(true);
    } finally {
      await long.release();
    }
  });

  it('lets the waiting writers of a writer that never came back expire 2 place timeouts after its attempt', async () => {
    const r = await app.locks.readLock('rw:ghost');
    // The attempt of a writer whose process then crashed: it neither tries again nor leaves.
    const store = (app.locks as unknown as { store: LockStore }).store;
    try {
      expect(await store.acquire({ key: 'rw:ghost', owner: 'ghost', leaseMs: 5_000, mode: 'write', queueTimeoutMs: 300 })).toMatchObject({ granted: false });
      expect(await raw.zscore('lock:{rw:ghost}:writers', 'ghost')).not.toBeNull();
      await until(async () => (await raw.exists('lock:{rw:ghost}:writers')) === 0, 5_000, 'the waiting writers outlived 2 place timeouts of 300 ms');
      expect(r.isHeld).toBe(true);
    } finally {
      await r.release();
    }
  });

  it("keeps a waiting writer's place when a writer with a shorter place timeout (another service's) attempts after it", async () => {
    // The waiting writers share one key: before, each attempt set its expiry to 2 of its own place
    // timeouts, and the short one's attempt cut the patient writer's place with it.
    const key = 'rw:mixed-places';
    const writers = `lock:{${key}}:writers`;
    const r = await app.locks.readLock(key);
    const store = (app.locks as unknown as { store: LockStore }).store;
    try {
      expect(await store.acquire({ key, owner: 'patient', leaseMs: 5_000, mode: 'write', queueTimeoutMs: 10_000 })).toMatchObject({ granted: false });
      expect(await store.acquire({ key, owner: 'hasty', leaseMs: 5_000, mode: 'write', queueTimeoutMs: 300 })).toMatchObject({ granted: false });
      expect(await raw.pttl(writers)).toBeGreaterThan(19_000);
      // Past 2 of the hasty writer's place timeouts, the patient writer still keeps new readers out.
      const from = await redisNowMs(raw);
      await until(async () => (await redisNowMs(raw)) > from + 700, 5_000, '700 ms of Redis time');
      expect(await canRead(key)).toBe(false);
      expect(await raw.zrange(writers, '0', '-1')).toEqual(['patient']);
    } finally {
      await store.abandon(key, 'patient', 'write', false);
      await r.release();
    }
  });

  it('wakes the readers that waited behind a writer that gave up: they get in when it leaves, not at the read lock\'s lease', async () => {
    // A read lock whose lease (30 s) outlasts the new reader's wait (10 s): before, the reader
    // slept until its wait ran out, and got in only then.
    const r = await app.locks.readLock('rw:gave-up', { leaseMs: 30_000 });
    const writerWaits = nextEvent(app.locks.events$, 'contended', (e) => e.key === 'rw:gave-up');
    const writing = elsewhere(() => app.locks.writeLock('rw:gave-up', { waitMs: 300 }));
    const readerWaits = writerWaits.then(() => nextEvent(app.locks.events$, 'contended', (e) => e.key === 'rw:gave-up'));
    const reading = writerWaits.then(() => new AsyncResource('a-reader').runInAsyncScope(() => app.locks.readLock('rw:gave-up', { waitMs: 10_000 })));
    try {
      // The reader waits: the writer's place keeps it out of a read lock it would share.
      await readerWaits;
      await expect(writing).rejects.toBeInstanceOf(LockNotAcquiredError);
      const read = await within(reading, 2_000);
      expect(read.holdCount).toBe(1);
      await read.release();
    } finally {
      reading.catch(() => undefined);
      await r.release();
    }
  });

  it('removes a writer that gave up from the waiting writers, letting readers in again', async () => {
    const r = await app.locks.readLock('rw:8');
    await expect(elsewhere(() => app.locks.writeLock('rw:8', { waitMs: 100 }))).rejects.toBeInstanceOf(LockNotAcquiredError);
    expect(await raw.zcard('lock:{rw:8}:writers')).toBe(0);
    expect(await canRead('rw:8')).toBe(true);
    await r.release();
  });

  it('renews both sides and signals their loss', async () => {
    const reader = await app.locks.readLock('rw:9');
    const renewed = await nextEvents(app.locks.events$, 'renewed', 4);
    expect(renewed.every((e) => e.key === 'rw:9')).toBe(true);
    await raw.del('lock:{rw:9}');
    expect(((await aborted(reader.signal)) as LockLostError).reason).toBe('taken');
    const writer = await app.locks.writeLock('rw:9');
    await raw.del('lock:{rw:9}');
    expect(((await aborted(writer.signal)) as LockLostError).reason).toBe('taken');
  });

  it('rejects fair mode for read-write locks', async () => {
    await expect(app.locks.acquire('rw:10', { mode: 'read', fair: true })).rejects.toThrow(/fair mode is for exclusive locks/);
    await expect(app.locks.acquire('rw:10', { mode: 'write', fair: true })).rejects.toThrow(/fair mode is for exclusive locks/);
    expect(await raw.exists('lock:{rw:10}')).toBe(0);
    await expect(app.locks.acquire('rw:10', { mode: 'upgrade' as never })).rejects.toThrow(/mode must be 'read' or 'write'/);
  });
});

describe('read-write locks across processes', () => {
  let redis: RedisServer;
  beforeAll(async () => {
    redis = await RedisServer.start();
  });
  afterAll(async () => {
    await redis?.stop();
  });

  const race = async (mode: 'locked' | 'unlocked') => {
    const children = [0, 1].map(() => new Fixture('rw-worker', [redis.url, '1', '3', '40', mode]));
    try {
      await Promise.all(children.map((c) => c.next('ready')));
      for (const c of children) c.send({ type: 'go' });
      const done = await Promise.all(children.map((c) => c.next('done', undefined, 120_000)));
      return done.reduce((t, d) => ({ mismatches: t.mismatches + Number(d.mismatches), overlaps: t.overlaps + Number(d.overlaps) }), { mismatches: 0, overlaps: 0 });
    } finally {
      await Promise.all(children.map((c) => c.stop()));
    }
  };

  it('never shows a reader a half-written value, and keeps writers exclusive (2 processes x 1 writer + 3 readers)', async () => {
    expect(await race('locked')).toEqual({ mismatches: 0, overlaps: 0 });
  });

  it('shows half-written values without the lock (the test above can catch a violation)', async () => {
    const result = await race('unlocked');
    expect(result.mismatches + result.overlaps).toBeGreaterThan(0);
  });
});

describe('@Locked read and write sides', () => {
  it('takes the side the decorator names', async () => {
    const redis = await RedisServer.start();
    @Injectable()
    class Docs {
      constructor(readonly locks: LockService) {}
      @Locked('doc:<0>', { mode: 'read' })
      async read(id: string) {
        return this.locks.current()?.key;
      }
      @Locked('doc:<0>', { mode: 'write' })
      async write(id: string) {
        return this.read(id); // a writer may read
      }
    }
    @Module({ imports: [LockModule.forRoot({ redis: redis.url })], providers: [Docs] })
    class DocsModule {}
    const moduleRef = await Test.createTestingModule({ imports: [DocsModule] }).setLogger(new CapturingLogger()).compile();
    await moduleRef.init();
    try {
      const docs = moduleRef.get(Docs);
      const acquired = nextEvent(moduleRef.get(LockService).events$, 'acquired');
      expect(await docs.write('d1')).toBe('doc:d1');
      await acquired;
      expect(await Promise.all([docs.read('d2'), docs.read('d2')])).toEqual(['doc:d2', 'doc:d2']);
      expect(() => {
        class Bad {
          @Locked('x', { mode: 'exclusive' as never })
          async run() {}
        }
        return Bad;
      }).toThrow(/mode must be 'read' or 'write'/);
    } finally {
      await moduleRef.close();
      await redis.stop();
    }
  });
});
