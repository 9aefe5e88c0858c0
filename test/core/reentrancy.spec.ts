import { AsyncResource } from 'node:async_hooks';
import { EventEmitterAsyncResource } from 'node:events';
import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Injectable, Module } from '@nestjs/common';
import { Test, type TestingModule } from '@nestjs/testing';
import type { Redis } from 'ioredis';
import { LockConfigurationError, LockHandle, Locked, LockModule, LockNotAcquiredError, LockService, type LockEvent, type LockLostError } from '../../lib/index.js';
import { RedisServer, until } from '../support/redis-server.js';
import { aborted, CapturingLogger, gate, nextEvent, stall, startLockApp, usePrivateLockApp, type LockApp } from '../support/lock-testing.js';
import { Fixture } from '../support/children.js';

describe('owners and reentrancy', () => {
  let redis: RedisServer;
  let app: LockApp;
  let raw: Redis;
  usePrivateLockApp({ waitMs: 200 }, (started) => ({ redis, raw, app } = started));

  // Created outside any lock context: code run in its scope is another context, even when called
  // from inside a run() callback.
  const outside = new AsyncResource('another-context');
  const otherContextGetsIt = (key: string) =>
    outside.runInAsyncScope(async () => {
      const other = await app.locks.tryAcquire(key);
      await other?.release();
      return other !== null;
    });

  it('re-enters inside one context: hold count 2, released only by the outer release', async () => {
    const key = 'reentrant:1';
    const events: LockEvent[] = [];
    const watching = app.locks.events$.subscribe((e) => e.key === key && events.push(e));
    let owner = '';
    await app.locks.run(key, async (outer) => {
      owner = outer.owner;
      expect(outer.holdCount).toBe(1);
      const inner = await app.locks.acquire(key);
      expect(inner.holdCount).toBe(2);
      expect(await app.locks.holdCount(key)).toBe(2);
      expect(inner.fencingToken).toBe(outer.fencingToken);
      expect(await otherContextGetsIt(key)).toBe(false);
      await inner.release();
      expect(await app.locks.holdCount(key)).toBe(1);
      expect(await app.locks.isLocked(key)).toBe(true);
      expect(await otherContextGetsIt(key)).toBe(false);
    });
    watching.unsubscribe();
    // The owner's events say the same (the other context's tries are 'contended'): the inner
    // acquisition is a re-entry, and each release says how many holds are left.
    const steps = events.filter((e) => e.owner === owner).map((e) => `${e.type} ${'holdCount' in e ? e.holdCount : ''}`.trim());
    expect(steps).toEqual(['acquired', 'reentered 2', 'released 1', 'released 0']);
    expect(await app.locks.isLocked(key)).toBe(false);
    expect(await otherContextGetsIt(key)).toBe(true);
  });

  it('never frees a lock at the release of one hold of several, even when Redis counts the last hold', async () => {
    // Redis counts a hold fewer than this process: here other code decremented it (the lock keys
    // must be left alone); after a dropped connection a release run twice does the same.
    const key = 'reentrant:short';
    const outer = await app.locks.acquire(key);
    const inner = await outer.run(() => app.locks.acquire(key));
    expect(inner.holdCount).toBe(2);
    await redis.shared().hincrby(`lock:{${key}}`, outer.owner, -1);
    await inner.release();
    // Freed, the lock could be taken by another owner while the outer handle still works under it.
    expect(await redis.shared().hgetall(`lock:{${key}}`)).toEqual({ [outer.owner]: '1' });
    expect(await otherContextGetsIt(key)).toBe(false);
    expect(outer.signal.aborted).toBe(false);
    await outer.release();
    expect(await app.locks.isLocked(key)).toBe(false);
  });

  it('never frees a lock of an explicit owner at the release of one of its holds here, even when Redis counts the last hold', async () => {
    // An owner token other processes may share: this process cannot count all its holds, but it
    // knows it still holds the lock, so the release keeps it.
    const key = 'reentrant:short:owner';
    const outer = await app.locks.acquire(key, { owner: 'job-7' });
    const inner = await app.locks.acquire(key, { owner: 'job-7' });
    expect(inner.holdCount).toBe(2);
    await redis.shared().hincrby(`lock:{${key}}`, 'job-7', -1);
    await inner.release();
    expect(await redis.shared().hgetall(`lock:{${key}}`)).toEqual({ 'job-7': '1' });
    expect(outer.signal.aborted).toBe(false);
    await outer.release();
    expect(await app.locks.isLocked(key)).toBe(false);
  });

  it.each(['read', 'write'] as const)('never frees a %s lock at the release of one hold of several, even when Redis counts the last hold', async (mode) => {
    const key = `reentrant:short:${mode}`;
    const field = (owner: string) => (mode === 'read' ? `${owner}:read` : owner);
    const outer = await app.locks.acquire(key, { mode });
    const inner = await outer.run(() => app.locks.acquire(key, { mode }));
    expect(inner.holdCount).toBe(2);
    await redis.shared().hincrby(`lock:{${key}}`, field(outer.owner), -1);
    await inner.release();
    expect(await redis.shared().hget(`lock:{${key}}`, field(outer.owner))).toBe('1');
    expect(outer.signal.aborted).toBe(false);
    await outer.release();
    expect(await app.locks.isLocked(key)).toBe(false);
  });

  it('lengthens a fixed lease when a re-entry asks for a longer one: the outer handle stays held past its own lease', async () => {
    const key = 'reentrant:fixed';
    await app.locks.run(key, async (outer) => {
      const inner = await app.locks.acquire(key, { leaseMs: 3_000 });
      expect(inner.holdCount).toBe(2);
      const pastOuterLease = performance.now() + 600;
      await until(async () => performance.now() > pastOuterLease, 5_000, 'the clock stood still');
      expect(outer.isHeld).toBe(true);
      expect(await redis.client().pttl(`lock:{${key}}`)).toBeGreaterThan(1_000);
      await inner.release();
    }, { leaseMs: 400 });
    expect(await app.locks.isLocked(key)).toBe(false);
  });

  it("keeps a fixed lease fixed when a re-entry asks for the watchdog: the outermost hold decides, and the lock ends with the re-entry's lease", async () => {
    const key = 'reentrant:fixed-then-watchdog';
    await app.locks.run(key, async (outer) => {
      const inner = await app.locks.acquire(key, { leaseMs: 1_000, watchdog: true });
      expect(inner.holdCount).toBe(2);
      // Not renewed: the lease the re-entry lengthened the lock to runs out, and both handles are told.
      expect(await aborted(inner.signal)).toMatchObject({ name: 'LockLostError', reason: 'lease-expired' });
      expect(outer.signal.aborted).toBe(true);
      // Its take-back was sent before this, on the same connection.
      expect(await app.locks.isLocked(key)).toBe(false);
      await inner.release();
    }, { leaseMs: 400 });
  });

  it('keeps renewing a lock under the watchdog when a re-entry asks for a fixed lease', async () => {
    const key = 'reentrant:watchdog-then-fixed';
    await app.locks.run(key, async (outer) => {
      const inner = await app.locks.acquire(key, { leaseMs: 300 });
      const pastBothLeases = performance.now() + 1_200;
      await until(async () => performance.now() > pastBothLeases, 5_000, 'the clock stood still');
      expect(inner.isHeld && outer.isHeld).toBe(true);
      expect(await raw.pttl(`lock:{${key}}`)).toBeGreaterThan(0);
      await inner.release();
    }, { leaseMs: 500, watchdog: true });
    expect(await app.locks.isLocked(key)).toBe(false);
  });

  it('re-enters however deep in awaits and timers the nested call is', async () => {
    const key = 'reentrant:deep';
    await app.locks.run(key, async () => {
      const nested = await new Promise<LockHandle>((resolve, reject) =>
        setTimeout(() => {
          Promise.resolve()
            .then(() => new Promise((r) => setImmediate(r)))
            .then(() => app.locks.acquire(key, { waitMs: 0 }))
            .then(resolve, reject);
        }, 5),
      );
      expect(nested.holdCount).toBe(2);
      await nested.release();
    });
  });

  it('gives work that outlives its lock an owner per acquisition: two callbacks of a consumer started inside a released lock contend', async () => {
    // A consumer (a socket, a queue client) created inside a lock runs its callbacks in that lock's
    // context, also after the release; they are independent messages, not the lock's own work.
    const consumer = await app.locks.run('consumer:start', async () => new EventEmitterAsyncResource({ name: 'consumer' }));
    const handled: Promise<LockHandle | null>[] = [];
    consumer.on('message', (key: string) => handled.push(app.locks.tryAcquire(key)));
    consumer.emit('message', 'order:1');
    const first = await handled[0];
    expect(first?.holdCount).toBe(1);
    consumer.emit('message', 'order:1');
    expect(await handled[1]).toBeNull(); // not a re-entry of the first message's lock
    expect(await consumer.asyncResource.runInAsyncScope(() => app.locks.holdCount('order:1'))).toBe(0);
    expect(consumer.asyncResource.runInAsyncScope(() => app.locks.current())).toBeUndefined();
    await first!.release();
    expect(await app.locks.isLocked('order:1')).toBe(false);
  });

  it('lets work started inside a lock share its owner while the lock is held, also when the inner lock it started in was released', async () => {
    await app.locks.run('outer:live', async () => {
      const consumer = await app.locks.run('inner:done', async () => new EventEmitterAsyncResource({ name: 'consumer' }));
      const nested = await consumer.asyncResource.runInAsyncScope(() => app.locks.acquire('outer:live', { waitMs: 0 }));
      expect(nested.holdCount).toBe(2);
      await nested.release();
    });
    expect(await app.locks.isLocked('outer:live')).toBe(false);
  });

  it('runs run() inside run() on the same key', async () => {
    const key = 'reentrant:run';
    const result = await app.locks.run(key, () => app.locks.run(key, async (inner) => inner.holdCount));
    expect(result).toBe(2);
    expect(await app.locks.isLocked(key)).toBe(false);
  });

  it('keeps two concurrent contexts in one process apart: the second waits for the first', async () => {
    const key = 'contend:1';
    const firstHolds = gate();
    const finishFirst = gate();
    const order: string[] = [];
    const first = app.locks.run(key, async () => {
      order.push('first in');
      firstHolds.open();
      await finishFirst.promise;
      order.push('first out');
    });
    await firstHolds.promise;
    const second = app.locks.run(key, async () => order.push('second in'), { waitMs: 10_000 });
    // The second context is refused while the first holds the key.
    await expect(app.locks.acquire(key, { waitMs: 0 })).rejects.toBeInstanceOf(LockNotAcquiredError);
    finishFirst.open();
    await Promise.all([first, second]);
    expect(order).toEqual(['first in', 'first out', 'second in']);
  });

  it('treats bare acquire() calls outside any context as different owners', async () => {
    const key = 'contend:bare';
    const a = await app.locks.acquire(key);
    await expect(app.locks.acquire(key, { waitMs: 0 })).rejects.toBeInstanceOf(LockNotAcquiredError);
    // handle.run() enters the handle's context, where the key re-enters.
    const nestedCount = await a.run(() => app.locks.run(key, async (h) => h.holdCount));
    expect(nestedCount).toBe(2);
    await a.release();
  });

  it('lets an owner token shared on purpose re-enter, and keeps other owners out', async () => {
    const key = 'token:1';
    const a = await app.locks.acquire(key, { owner: 'job-7' });
    const b = await app.locks.acquire(key, { owner: 'job-7', waitMs: 0 });
    expect(b.holdCount).toBe(2);
    expect(await app.locks.tryAcquire(key, { owner: 'job-8' })).toBeNull();
    expect(await app.locks.holdCount(key, { owner: 'job-7' })).toBe(2);
    await a.release();
    expect(await app.locks.isLocked(key)).toBe(true);
    await b.release();
    expect(await app.locks.isLocked(key)).toBe(false);
  });

  // Owners and keys may hold any character: no (owner, key) pair may be taken for another.
  it.each([
    ['the same letters split differently', ['night', 'shift'], ['nights', 'hift']],
    ['a NUL character in one owner and the other key', ['a\u0000b', 'c'], ['a', 'b\u0000c']],
  ])('keeps apart the locks of two owners whose owner and key join into one string (%s)', async (_, [ownerA, keyA], [ownerB, keyB]) => {
    const lost: string[] = [];
    const seen = app.locks.events$.subscribe((e) => e.type === 'lost' && lost.push(e.key));
    try {
      const a = await app.locks.acquire(keyA, { owner: ownerA, leaseMs: 60_000 });
      const b = await app.locks.acquire(keyB, { owner: ownerB, leaseMs: 60_000 });
      expect([a.isHeld, b.isHeld, a.holdCount, b.holdCount]).toEqual([true, true, 1, 1]);
      expect(await raw.hgetall(`lock:{${keyA}}`)).toEqual({ [ownerA]: '1' });
      expect(await raw.hgetall(`lock:{${keyB}}`)).toEqual({ [ownerB]: '1' });
      await a.release();
      expect(await raw.exists(`lock:{${keyA}}`)).toBe(0);
      expect(await raw.hgetall(`lock:{${keyB}}`)).toEqual({ [ownerB]: '1' });
      await b.release();
      expect(await raw.exists(`lock:{${keyB}}`)).toBe(0);
      expect(lost).toEqual([]);
    } finally {
      seen.unsubscribe();
    }
  });

  it('takes a grant of a lock its owner had lost unnoticed as fresh: the old handle is told, and its release leaves the new hold alone', async () => {
    const key = 'token:lost-unnoticed';
    const old = await app.locks.acquire(key, { owner: 'job-9', leaseMs: 60_000 });
    await raw.del(`lock:{${key}}`); // gone from Redis, and nothing has told this process
    const fresh = await app.locks.acquire(key, { owner: 'job-9', waitMs: 0 });
    expect(fresh.holdCount).toBe(1);
    expect(old.isHeld).toBe(false);
    expect((old.signal.reason as LockLostError).reason).toBe('taken');
    expect(fresh.isHeld).toBe(true);
    await old.release(); // the lost handle's release must not give back the new grant
    expect(await app.locks.holdCount(key, { owner: 'job-9' })).toBe(1);
    await fresh.release();
    expect(await app.locks.isLocked(key)).toBe(false);
  });

  it('hands a lock to another process through an owner token', async () => {
    const key = 'token:handover';
    const second = await startLockApp({ redis: redis.url });
    try {
      const a = await app.locks.acquire(key, { owner: 'transfer-1' });
      const reentered = nextEvent(second.locks.events$, 'reentered', (e) => e.key === key);
      const b = await second.locks.acquire(key, { owner: 'transfer-1', waitMs: 0 });
      expect(b.holdCount).toBe(2);
      // The second process's first hold is a re-entry of the owner's lock, and its events say so.
      expect(await reentered).toMatchObject({ owner: 'transfer-1', holdCount: 2 });
      await a.release();
      expect(await second.locks.holdCount(key, { owner: 'transfer-1' })).toBe(1);
      await b.release();
      expect(await app.locks.isLocked(key)).toBe(false);
    } finally {
      await second.close();
    }
  });

  it("keeps the lease of the process a lock is handed to when the first one renews a shorter lease and leaves", async () => {
    // One owner, one hash field in two processes: before, the first process's renewal set the
    // lock's lease to its own 900 ms, and the lock ended soon after it left, with the second
    // process holding it until its next renewal (at 3 s) told it.
    const key = 'token:handover-lease';
    const second = await startLockApp({ redis: redis.url });
    try {
      const a = await app.locks.acquire(key, { owner: 'transfer-2', leaseMs: 900, watchdog: true });
      const b = await second.locks.acquire(key, { owner: 'transfer-2', leaseMs: 9_000, watchdog: true, waitMs: 0 });
      await nextEvent(app.locks.events$, 'renewed', (e) => e.key === key);
      expect(await raw.pttl(`lock:{${key}}`)).toBeGreaterThan(900);
      await a.release();
      await expect(app.locks.acquire(key, { waitMs: 1_500 })).rejects.toBeInstanceOf(LockNotAcquiredError);
      expect(b.isHeld).toBe(true);
      await b.release();
      expect(await app.locks.isLocked(key)).toBe(false);
    } finally {
      await second.close();
    }
  });

  it('keeps the lease of the process a lock is handed to when the first one extends it to less', async () => {
    // One owner, one hash field in two processes: before, extend() set the lock's lease to 300 ms,
    // as for a holder alone, and the lock ended under the second process.
    const key = 'token:handover-extend';
    const second = await startLockApp({ redis: redis.url });
    try {
      const a = await app.locks.acquire(key, { owner: 'transfer-6', leaseMs: 20_000 });
      const b = await second.locks.acquire(key, { owner: 'transfer-6', leaseMs: 20_000, waitMs: 0 });
      await a.extend(300);
      expect(await raw.pttl(`lock:{${key}}`)).toBeGreaterThan(19_000);
      await a.release();
      // Alone now, the second process's extend() to less sets it shorter.
      await b.extend(300);
      expect(await raw.pttl(`lock:{${key}}`)).toBeLessThanOrEqual(300);
      await b.release();
      expect(await app.locks.isLocked(key)).toBe(false);
    } finally {
      await second.close();
    }
  });

  // One owner, one hash field in two processes: before, the first process took back every hold
  // of the field when it lost or left the lock, the second process's hold with them, and the lock
  // was free while that process still held it.
  it.each([
    ['a plain lock', undefined],
    ['a write lock', 'write'],
    ['a read lock', 'read'],
  ] as const)('leaves the hold of the process %s was handed to when the first one shuts down holding it: it gives back its own holds only', async (_what, mode) => {
    const key = `token:handover-shutdown:${mode ?? 'plain'}`;
    const first = await startLockApp({ redis: redis.url });
    try {
      await first.locks.acquire(key, { owner: 'transfer-3', mode });
      await first.locks.acquire(key, { owner: 'transfer-3', mode, waitMs: 0 });
      const b = await app.locks.acquire(key, { owner: 'transfer-3', mode, waitMs: 0 });
      expect(b.holdCount).toBe(3);
      await first.close();
      expect(await app.locks.holdCount(key, { owner: 'transfer-3', mode })).toBe(1);
      expect(await app.locks.tryAcquire(key, { mode: 'write' })).toBeNull();
      expect(b.isHeld).toBe(true);
      // Both holds of the first process are gone: the last release frees the lock.
      await b.release();
      expect(await app.locks.isLocked(key)).toBe(false);
    } finally {
      await first.close();
    }
  });

  it('leaves the hold of the process a lock was handed to when the first one loses it because its own fixed lease ran out', async () => {
    const key = 'token:handover-expired';
    const first = await startLockApp({ redis: redis.url });
    try {
      const a = await first.locks.acquire(key, { owner: 'transfer-4', leaseMs: 500 });
      // Its lease lengthens the lock's (a re-entry never shortens it), and its watchdog renews it.
      const b = await app.locks.acquire(key, { owner: 'transfer-4', leaseMs: 3_000, watchdog: true, waitMs: 0 });
      expect(b.holdCount).toBe(2);
      const lost = (await nextEvent(first.locks.events$, 'lost', (e) => e.key === key)) as { reason: string };
      expect(lost.reason).toBe('lease-expired');
      expect(a.isHeld).toBe(false);
      expect(await app.locks.holdCount(key, { owner: 'transfer-4' })).toBe(1);
      expect(await app.locks.tryAcquire(key)).toBeNull();
      expect(b.isHeld).toBe(true);
      await b.release();
      expect(await app.locks.isLocked(key)).toBe(false);
    } finally {
      await first.close();
    }
  });

  // A grant read after its lease ran out (this process stalled) is given back before a retry. Under
  // an owner token the other process's hold is in the same field: before, the give-back deleted
  // the field, and the lock ended under the other process once this one released.
  it('gives back one hold of a grant read after its lease ran out under an owner token, leaving the hold another process took meanwhile', async () => {
    const key = 'token:stale-grant';
    const joiner = new Fixture('token-joiner', [redis.url, key, 'transfer-8']);
    try {
      await joiner.next('ready');
      joiner.send({ type: 'watch' });
      await joiner.next('watching');
      // The acquire command leaves at once; its reply waits behind a CPU hog longer than the lease,
      // and the other process joins meanwhile.
      const acquiring = app.locks.acquire(key, { owner: 'transfer-8', leaseMs: 300, waitMs: 5_000 });
      stall(1_500);
      const lock = await acquiring;
      expect((await joiner.next('joined')).holdCount).toBe(2);
      // The retry re-entered the other process's hold.
      expect(lock.holdCount).toBe(2);
      await lock.release();
      expect(await raw.hget(`lock:{${key}}`, 'transfer-8')).toBe('1');
      expect(await raw.pttl(`lock:{${key}}`)).toBeGreaterThan(5_000);
      joiner.send({ type: 'release' });
      await joiner.next('done');
      expect(await raw.exists(`lock:{${key}}`)).toBe(0);
    } finally {
      await joiner.stop();
    }
  });

  // What Redis cannot tell apart: under an owner token, the hold another process took afresh after
  // this one's lease ran out is, to Redis, this process's old hold.
  it('a process stalled past its lease under an owner token reports the loss, and its give-back frees the lock another process took afresh under the token (which learns at its next renewal)', async () => {
    const key = 'token:stalled-past-lease';
    const taker = new Fixture('token-joiner', [redis.url, key, 'transfer-9', '', 'gone']);
    try {
      await taker.next('ready');
      const lock = await app.locks.acquire(key, { owner: 'transfer-9', leaseMs: 300, watchdog: true });
      const lost = nextEvent(app.locks.events$, 'lost', (e) => e.key === key);
      taker.send({ type: 'watch' });
      await taker.next('watching');
      // No renewal can run: the lease runs out in Redis, and the other process takes the lock afresh.
      stall(1_500);
      expect((await taker.next('joined')).holdCount).toBe(1);
      expect(((await lost) as { reason: string }).reason).toBe('lease-expired');
      expect(lock.isHeld).toBe(false);
      // The give-back this process sends for the hold it may still have had took the other's.
      await until(async () => (await raw.exists(`lock:{${key}}`)) === 0, 5_000, 'the lock freed under the other process');
      expect((await taker.next('lost')).reason).toBe('taken');
      taker.send({ type: 'release' });
      await taker.next('done');
    } finally {
      await taker.stop();
    }
  });

  it('gives current() the innermost lock of the context', async () => {
    expect(app.locks.current()).toBeUndefined();
    await app.locks.run('outer:c', async (outer) => {
      expect(app.locks.current()).toBe(outer);
      await app.locks.run('inner:c', async (inner) => {
        expect(app.locks.current()).toBe(inner);
        expect(app.locks.current('outer:c')).toBe(outer);
      });
      expect(app.locks.current()).toBe(outer);
    });
    expect(app.locks.current()).toBeUndefined();
  });

  it('returns run()\'s value and rethrows its error unchanged, releasing either way', async () => {
    const key = 'run:outcome';
    await expect(app.locks.run(key, async () => 42)).resolves.toBe(42);
    const failure = new RangeError('business rule');
    await expect(app.locks.run(key, async () => { throw failure; })).rejects.toBe(failure);
    expect(await app.locks.isLocked(key)).toBe(false);
  });

  it('release() is idempotent: a second call changes nothing', async () => {
    const key = 'release:twice';
    await app.locks.run(key, async () => {
      const inner = await app.locks.acquire(key);
      await inner.release();
      await inner.release();
      expect(await app.locks.holdCount(key)).toBe(1);
    });
    expect(await app.locks.isLocked(key)).toBe(false);
  });
});

@Injectable()
class Ledger {
  readonly debited: number[] = [];
  constructor(readonly locks: LockService) {}
  @Locked('account:<0>', { waitMs: 20_000 })
  async debit(id: number) {
    this.debited.push(id);
    return `debited ${id}`;
  }
}

@Injectable()
class Transfers {
  constructor(
    readonly ledger: Ledger,
    readonly locks: LockService,
  ) {}
  @Locked('account:<0>', { waitMs: 20_000 })
  async transfer(id: number) {
    return this.ledger.debit(id);
  }
  @Locked('transfer:<0>', { waitMs: 20_000 })
  async transferOther(id: number) {
    return this.ledger.debit(id);
  }
}

@Injectable()
class Archive {
  constructor(readonly locks: LockService) {}
}

describe('LockModule.forRoot() imported twice in one application', () => {
  // Each import makes a LockService of its own: a lock is reentrant only through the one that took
  // it, so a @Locked method calling another module's @Locked method on the same key would wait for
  // its caller's lock until waitMs (20 s here) ran out.
  let redis: RedisServer;
  let other: RedisServer;
  let app: TestingModule;
  let outerLocks: LockService;
  let innerLocks: LockService;
  let elsewhereLocks: LockService;
  const logger = new CapturingLogger();
  beforeAll(async () => {
    [redis, other] = await Promise.all([RedisServer.start(), RedisServer.start()]);
    @Module({ imports: [LockModule.forRoot({ redis: redis.url })], providers: [Ledger], exports: [Ledger] })
    class LedgerModule {}
    @Module({ imports: [LedgerModule, LockModule.forRoot({ redis: redis.url })], providers: [Transfers] })
    class TransfersModule {}
    // A third import, on another Redis: the same key names there are other locks.
    @Module({ imports: [LockModule.forRoot({ redis: other.url })], providers: [Archive] })
    class ArchiveModule {}
    app = await Test.createTestingModule({ imports: [TransfersModule, ArchiveModule] }).setLogger(logger).compile();
    await app.init();
    innerLocks = app.get(Ledger).locks;
    outerLocks = app.get(Transfers).locks;
    elsewhereLocks = app.get(Archive).locks;
  });
  afterAll(async () => {
    await app?.close();
    await Promise.all([redis?.stop(), other?.stop()]);
  });

  it('has three LockServices (the setup this block is about)', () => {
    expect(innerLocks).toBeInstanceOf(LockService);
    expect(outerLocks).toBeInstanceOf(LockService);
    expect(innerLocks).not.toBe(outerLocks);
    expect(new Set([innerLocks, outerLocks, elsewhereLocks]).size).toBe(3);
  });

  it('says so once at bootstrap, at warn level: how many imports, and to import LockModule.forRoot() once', () => {
    const warnings = logger.entries.filter((e) => e.level === 'warn' && e.context === 'LockService' && e.message.includes('imported'));
    expect(warnings.map((e) => e.message)).toEqual([expect.stringMatching(/^LockModule\.forRoot\(\) is imported 3 times in this application: each import makes a LockService of its own.*Import LockModule\.forRoot\(\) once, with isGlobal: true/)]);
  });

  it('fails the inner @Locked call at once with a LockConfigurationError that says to import LockModule.forRoot() once, instead of waiting for its own caller', async () => {
    const transfers = app.get(Transfers);
    const started = performance.now();
    const failure = await transfers.transfer(1).catch((e: unknown) => e);
    expect(performance.now() - started).toBeLessThan(5_000);
    expect(failure).toBeInstanceOf(LockConfigurationError);
    expect((failure as Error).message).toMatch(/Lock "account:1" is held by this same call, through another LockService: LockModule.forRoot\(\) .* imported more than once/);
    expect((failure as Error).message).toMatch(/Import LockModule.forRoot\(\) once, with isGlobal: true/);
    expect(transfers.ledger.debited).not.toContain(1);
    // The outer lock was released with the failure.
    expect(await outerLocks.isLocked('account:1')).toBe(false);
  });

  it('does the same for run() inside run() on the two services, and leaves the outer lock held', async () => {
    await outerLocks.run('account:2', async (outer) => {
      await expect(innerLocks.run('account:2', async () => 'inner ran')).rejects.toBeInstanceOf(LockConfigurationError);
      expect(outer.isHeld).toBe(true);
      expect(await outerLocks.holdCount('account:2')).toBe(1);
    });
    expect(await innerLocks.isLocked('account:2')).toBe(false);
  });

  it('does the same for a multi-key lock whose keys include the caller\'s', async () => {
    await outerLocks.run('account:3', async () => {
      await expect(innerLocks.run(['account:3', 'account:4'], async () => 'inner ran')).rejects.toBeInstanceOf(LockConfigurationError);
    });
    expect(await innerLocks.isLocked('account:4')).toBe(false);
  });

  it('does the same for a fair and a write acquisition, and leaves nothing queued behind', async () => {
    await outerLocks.run('account:8', async () => {
      await expect(innerLocks.run('account:8', async () => 'inner ran', { fair: true })).rejects.toBeInstanceOf(LockConfigurationError);
    });
    await outerLocks.run('account:9', async () => {
      await expect(innerLocks.run('account:9', async () => 'inner ran', { mode: 'write' })).rejects.toBeInstanceOf(LockConfigurationError);
    }, { mode: 'read' });
    const raw = redis.client();
    expect(await raw.exists('lock:{account:8}', 'lock:{account:8}:queue', 'lock:{account:9}', 'lock:{account:9}:writers')).toBe(0);
  });

  it('lets nested calls on the two services take different keys', async () => {
    expect(await app.get(Transfers).transferOther(5)).toBe('debited 5');
  });

  it('keeps tryAcquire() an answer, not an error: the key is held (the caller only asked whether it is free)', async () => {
    await outerLocks.run('account:6', async () => {
      expect(await innerLocks.tryAcquire('account:6')).toBeNull();
    });
  });

  it('still waits when the caller holds the same key name through a service of this application on another Redis (another lock) and a third owner holds it here', async () => {
    const holder = await innerLocks.acquire('account:7', { leaseMs: 5_000 });
    await elsewhereLocks.run('account:7', async () => {
      const failure = await innerLocks.acquire('account:7', { waitMs: 300 }).catch((e: unknown) => e);
      expect(failure).toBeInstanceOf(LockNotAcquiredError);
      expect((failure as LockNotAcquiredError).reason).toBe('timeout');
    });
    await holder.release();
  });
});

describe('two Nest applications in one process', () => {
  let a: LockApp;
  let b: LockApp;
  usePrivateLockApp({}, (started) => ({ app: a, other: b } = started), {});

  it('do not warn about LockModule.forRoot() imported twice: each application imports it once', () => {
    for (const each of [a, b]) expect(each.logger.at('warn').filter((m) => m.includes('imported'))).toEqual([]);
  });

  it("never look at each other's locks: a nested acquisition of one inside the other's lock waits like any owner's (no LockConfigurationError)", async () => {
    await a.locks.run('apps:nested', async () => {
      const failure = await b.locks.acquire('apps:nested', { waitMs: 300 }).catch((e: unknown) => e);
      expect(failure).toBeInstanceOf(LockNotAcquiredError);
      expect((failure as LockNotAcquiredError).reason).toBe('timeout');
    });
  });
});
