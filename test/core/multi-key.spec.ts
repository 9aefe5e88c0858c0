import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Injectable, Module } from '@nestjs/common';
import { Test, type TestingModule } from '@nestjs/testing';
import type { Redis } from 'ioredis';
import { Locked, LockGroup, LockModule, LockNotAcquiredError, LockService, type LockLostError } from '../../lib/index.js';
import { Fixture } from '../support/children.js';
import { RedisServer, until } from '../support/redis-server.js';
import { aborted, asleep, CapturingLogger, nextEvent, signalHooks, usePrivateLockApp, type LockApp } from '../support/lock-testing.js';

describe('multi-key locks', () => {
  let redis: RedisServer;
  let raw: Redis;
  let app: LockApp;
  let other: LockApp;
  usePrivateLockApp({ leaseMs: 600 }, (started) => ({ redis, raw, app, other } = started), {});

  const held = (...keys: string[]) => raw.exists(...keys.map((k) => `lock:{${k}}`));

  /** Runs `fn` with the store's atomic multi-key step taken away, as on keys spread over Cluster slots: one key at a time. */
  async function oneKeyAtATime(fn: () => Promise<void>): Promise<void> {
    const store = (app.locks as unknown as { store: { acquireMany?: unknown } }).store;
    const atomic = store.acquireMany;
    store.acquireMany = undefined;
    try {
      await fn();
    } finally {
      store.acquireMany = atomic;
    }
  }

  it('takes every key, in canonical order, with one fencing token per key, and releases them all', async () => {
    const group = await app.locks.acquire(['m:b', 'm:a', 'm:b']);
    expect(group).toBeInstanceOf(LockGroup);
    expect(group.keys).toEqual(['m:a', 'm:b']);
    expect(Object.keys(group.fencingTokens)).toEqual(['m:a', 'm:b']);
    expect(await held('m:a', 'm:b')).toBe(2);
    await group.release();
    expect(await held('m:a', 'm:b')).toBe(0);
  });

  it('is all or nothing: when one key is held elsewhere, none of the others stays held', async () => {
    const blocker = await other.locks.acquire('m:3');
    const failure = (await app.locks.acquire(['m:1', 'm:2', 'm:3'], { waitMs: 0 }).catch((e: unknown) => e)) as LockNotAcquiredError;
    expect(failure).toBeInstanceOf(LockNotAcquiredError);
    expect(failure.key).toBe('m:3');
    expect(await held('m:1', 'm:2')).toBe(0);
    expect(await app.locks.tryAcquire(['m:1', 'm:3'])).toBeNull();
    await blocker.release();
  });

  it('rolls back a partially taken group on a store without an atomic multi-key step', async () => {
    await oneKeyAtATime(async () => {
      const blocker = await other.locks.acquire('p:3');
      const taken: string[] = [];
      const subscription = app.locks.events$.subscribe((e) => e.type === 'acquired' && taken.push(e.key));
      await expect(app.locks.acquire(['p:1', 'p:2', 'p:3'], { waitMs: 100 })).rejects.toBeInstanceOf(LockNotAcquiredError);
      subscription.unsubscribe();
      expect(taken).toEqual(['p:1', 'p:2']); // it did take the first two...
      expect(await held('p:1', 'p:2')).toBe(0); // ...and gave them back
      await blocker.release();
      const group = await app.locks.acquire(['p:2', 'p:1']);
      expect(group.keys).toEqual(['p:1', 'p:2']);
      await group.release();
    });
  });

  it('waits for a key held elsewhere and takes the whole group when it is released', async () => {
    const blocker = await other.locks.acquire('w:2');
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === 'w:2');
    const waiting = app.locks.acquire(['w:1', 'w:2'], { waitMs: 10_000 });
    await contended;
    expect(await held('w:1')).toBe(0); // nothing taken while waiting
    await blocker.release();
    const group = await waiting;
    expect(group.isHeld).toBe(true);
    await group.release();
  });

  it('gives up when waitMs ends, naming the key that blocks it, in its error and its contended and timed-out events', async () => {
    const blocker = await other.locks.acquire('t:2', { leaseMs: 30_000 });
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === 't:2');
    const timedOut = nextEvent(app.locks.events$, 'timed-out', (e) => e.key === 't:2');
    const failure = (await app.locks.acquire(['t:1', 't:2'], { waitMs: 300 }).catch((e: unknown) => e)) as LockNotAcquiredError;
    expect(failure).toBeInstanceOf(LockNotAcquiredError);
    expect(failure).toMatchObject({ key: 't:2', reason: 'timeout' });
    expect(failure.waitedMs).toBeGreaterThanOrEqual(300);
    const event = await timedOut;
    expect(event.waitedMs).toBeGreaterThanOrEqual(300);
    expect(event.waitedMs).toBeLessThanOrEqual(failure.waitedMs); // measured just before the error
    // Its contended event named the same key, and when to try again: the blocker's lease left.
    const { retryAfterMs } = await contended;
    expect(retryAfterMs).toBeGreaterThan(29_000);
    expect(retryAfterMs).toBeLessThanOrEqual(30_000);
    expect(await held('t:1')).toBe(0);
    await blocker.release();
  });

  it('follows the key that blocks it: a waiter blocked by one key, then by another, takes the group at the second key\'s release', async () => {
    const first = await other.locks.acquire('f:1');
    const second = await other.locks.acquire('f:2', { leaseMs: 30_000 });
    const blockedByFirst = nextEvent(app.locks.events$, 'contended', (e) => e.key === 'f:1');
    const waiting = app.locks.acquire(['f:1', 'f:2'], { waitMs: 10_000 });
    await blockedByFirst;
    await until(async () => asleep(app, 'f:1') === 1, 5_000, 'the group asleep on f:1');
    await first.release();
    // Woken, it finds f:2 held, watches f:2 instead, and sleeps there: not for f:2's 30 s lease,
    // nor for the rest of its wait, but until f:2's release.
    await until(async () => asleep(app, 'f:2') === 1, 5_000, 'the group asleep on f:2');
    expect(await held('f:1')).toBe(0);
    await second.release();
    const group = await waiting;
    expect(group.isHeld).toBe(true);
    await group.release();
  });

  it('bounds the whole wait of a group taken one key at a time by waitMs, not waitMs per key', async () => {
    const first = await other.locks.acquire('b:1');
    const second = await other.locks.acquire('b:2');
    try {
      await oneKeyAtATime(async () => {
        const blocked = nextEvent(app.locks.events$, 'contended', (e) => e.key === 'b:1');
        const started = performance.now();
        const waiting = app.locks.acquire(['b:1', 'b:2'], { waitMs: 1_500 }).catch((e: unknown) => e);
        await blocked;
        // b:1 comes free 800 ms into the wait; b:2 never does. What is left for b:2 is the rest
        // of the 1.5 s, not another 1.5 s.
        await new Promise((resolve) => setTimeout(resolve, 800));
        await first.release();
        const failure = (await waiting) as LockNotAcquiredError;
        const waited = performance.now() - started;
        expect(failure).toBeInstanceOf(LockNotAcquiredError);
        expect(failure.key).toBe('b:2');
        expect(waited).toBeGreaterThanOrEqual(1_400);
        expect(waited).toBeLessThan(2_000);
        expect(await held('b:1')).toBe(0); // given back
      });
    } finally {
      await second.release();
    }
  });

  it('re-enters keys the context already holds, and run() nests groups in single locks', async () => {
    await app.locks.run('r:1', async () => {
      await app.locks.run(['r:2', 'r:1'], async (group) => {
        expect(group.handle('r:1')!.holdCount).toBe(2);
        expect(group.handle('r:2')!.holdCount).toBe(1);
        expect(app.locks.current('r:2')).toBe(group.handle('r:2'));
        expect((await app.locks.acquire('r:2')).holdCount).toBe(2);
      });
      expect(await held('r:2')).toBe(1); // the nested acquire above was not released on purpose
    });
    await raw.del('lock:{r:2}');
  });

  it('finds the locks of the enclosing contexts from inside a group: current(key) of an outer key is its handle', async () => {
    await app.locks.run('c:outer', async (outer) => {
      await app.locks.run(['c:2', 'c:1'], async (group) => {
        expect(app.locks.current('c:outer')).toBe(outer);
        expect(app.locks.current()).toBe(group.handle('c:1'));
      });
    });
  });

  it("sends a group's releases together, the last key (in canonical order) first", async () => {
    const group = await app.locks.acquire(['o:b', 'o:c', 'o:a']);
    const released: string[] = [];
    const watching = app.locks.events$.subscribe((e) => e.type === 'released' && released.push(e.key));
    await group.release();
    watching.unsubscribe();
    expect(released).toEqual(['o:c', 'o:b', 'o:a']);
    expect(await held('o:a', 'o:b', 'o:c')).toBe(0);
  });

  it('lengthens a fixed lease when a group re-enters keys with a longer one: every key stays held past the outer lease', async () => {
    await app.locks.run(['rl:1', 'rl:2'], async (outer) => {
      const inner = await app.locks.acquire(['rl:2', 'rl:1'], { leaseMs: 3_000 });
      expect(inner.handles.map((h) => h.holdCount)).toEqual([2, 2]);
      const pastOuterLease = performance.now() + 600;
      await until(async () => performance.now() > pastOuterLease, 5_000, 'the clock stood still');
      expect(outer.isHeld).toBe(true);
      for (const key of ['rl:1', 'rl:2']) expect(await raw.pttl(`lock:{${key}}`)).toBeGreaterThan(1_000);
      await inner.release();
    }, { leaseMs: 400 });
    expect(await held('rl:1', 'rl:2')).toBe(0);
  });

  it('renews every key and aborts the group\'s signal when any key is lost', async () => {
    const group = await app.locks.acquire(['l:1', 'l:2']);
    await nextEvent(app.locks.events$, 'renewed', (e) => e.key === 'l:2');
    await raw.del('lock:{l:2}');
    const reason = (await aborted(group.signal)) as LockLostError;
    expect(reason.key).toBe('l:2');
    expect(group.handle('l:1')!.isHeld).toBe(true);
    // The group's signal, aborted, no longer listens to the key still held.
    expect(signalHooks(group.handle('l:1')!.signal)).toEqual({ dependants: 0, listeners: 0 });
    expect(group.isHeld).toBe(false); // not every key is held any more
    await group.release();
    expect(await held('l:1')).toBe(0);
  });

  it("reads as aborted when first read after a key was lost, and when read after the event loop was blocked past a key's lease", async () => {
    const group = await app.locks.acquire(['l:3', 'l:4']);
    const lost = nextEvent(app.locks.events$, 'lost', (e) => e.key === 'l:4');
    await raw.del('lock:{l:4}');
    await lost;
    expect(group.signal.aborted).toBe(true); // its first read
    expect((group.signal.reason as LockLostError).key).toBe('l:4');
    await group.release();

    const fixed = await app.locks.acquire(['b:1', 'b:2'], { leaseMs: 300 }); // no watchdog: nothing renews it
    expect(fixed.signal.aborted).toBe(false);
    const until = performance.now() + 500;
    while (performance.now() < until) {
      /* a synchronous CPU hog longer than the lease: no timer of the library runs meanwhile */
    }
    expect(fixed.signal.aborted).toBe(true); // this read checked the deadlines
    expect((fixed.signal.reason as LockLostError).reason).toBe('lease-expired');
    await fixed.release();
  });

  it('leaves nothing on a lock it re-entered once the group is released, and a released group is not aborted by a later loss', async () => {
    const outer = await app.locks.acquire('o:1');
    await outer.run(async () => {
      const before = signalHooks(outer.signal);
      for (let i = 0; i < 3; i++) {
        const group = await app.locks.acquire(['o:1', `o:${i + 2}`]);
        expect(group.handle('o:1')!.holdCount).toBe(2);
        expect(group.signal.aborted).toBe(false);
        await (i === 2 ? app.locks.releaseQuietly(group) : group.release());
        expect(signalHooks(outer.signal)).toEqual(before);
      }
      const released = await app.locks.acquire(['o:1', 'o:9']);
      const watched = released.signal;
      await released.release();
      const lost = nextEvent(app.locks.events$, 'lost', (e) => e.key === 'o:1');
      await raw.del('lock:{o:1}');
      await lost;
      expect(outer.signal.aborted).toBe(true);
      expect(watched.aborted).toBe(false);
    });
    expect(await held('o:1', 'o:2', 'o:3', 'o:4', 'o:9')).toBe(0);
  });

  it("is not aborted by the later loss of a key whose handle was released on its own before the group's signal was first read", async () => {
    const outer = await app.locks.acquire('p:1');
    await outer.run(async () => {
      const group = await app.locks.acquire(['p:1', 'p:2']);
      await group.handle('p:1')!.release(); // the group's re-entry only: the outer hold stays
      const lost = nextEvent(app.locks.events$, 'lost', (e) => e.key === 'p:1');
      await raw.del('lock:{p:1}');
      await lost;
      expect(outer.signal.aborted).toBe(true);
      expect(group.signal.aborted).toBe(false); // its first read: it follows p:2 only
      expect(group.handle('p:2')!.isHeld).toBe(true);
      await group.release();
    });
    expect(await held('p:1', 'p:2')).toBe(0);
  });

  it("extend() sets every key's remaining lease, shorter too, and the watchdog then renews each key with that lease", async () => {
    const fixed = await app.locks.acquire(['x:1', 'x:2'], { leaseMs: 1_000 });
    await fixed.extend(20_000);
    for (const key of ['x:1', 'x:2']) expect(await app.locks.remainingTtl(key)).toBeGreaterThan(19_000);
    await fixed.extend(2_000);
    for (const key of ['x:1', 'x:2']) expect(await app.locks.remainingTtl(key)).toBeLessThanOrEqual(2_000);
    await fixed.release();
    const renewing = await app.locks.acquire(['x:3', 'x:4']); // the module's 600 ms lease, renewed
    await renewing.extend(3_000);
    const renewed = await nextEvent(app.locks.events$, 'renewed', (e) => e.key === 'x:4');
    expect(renewed.leaseMs).toBe(3_000);
    expect(await app.locks.remainingTtl('x:4')).toBeGreaterThan(2_000);
    await renewing.release();
    expect(await held('x:1', 'x:2', 'x:3', 'x:4')).toBe(0);
  });

  it('refuses groups with a mode or fair, and empty groups', async () => {
    await expect(app.locks.acquire(['a', 'b'], { mode: 'read' })).rejects.toThrow(/multi-key locks are exclusive/);
    await expect(app.locks.acquire([])).rejects.toThrow(/at least one key/);
    await expect(app.locks.acquire(['ok', 'bad{x}'])).rejects.toThrow(/contains "\{" or "\}"/);
  });
});

describe('opposite-order transfers across processes', () => {
  let redis: RedisServer;
  beforeAll(async () => {
    redis = await RedisServer.start();
  });
  afterAll(async () => {
    await redis?.stop();
  });

  it('finishes 100 concurrent A->B and B->A transfers in 2 processes without deadlock, total unchanged', async () => {
    const raw = redis.client();
    await raw.mset('balance:A', 1_000, 'balance:B', 1_000);
    const children = [0, 1].map(() => new Fixture('transfer-worker', [redis.url, '50']));
    try {
      await Promise.all(children.map((c) => c.next('ready')));
      for (const c of children) c.send({ type: 'go' });
      await Promise.all(children.map((c) => c.next('done', undefined, 60_000)));
    } finally {
      await Promise.all(children.map((c) => c.stop()));
    }
    const [a, b] = (await raw.mget('balance:A', 'balance:B')).map(Number);
    expect(a! + b!).toBe(2_000);
    // 50 each way: every transfer applied exactly once.
    expect(a).toBe(1_000);
  });
});

describe('@Locked with several keys', () => {
  @Injectable()
  class Transfers {
    constructor(readonly locks: LockService) {}
    @Locked(['account:<0>', 'account:<1>'])
    async transfer(from: string, to: string) {
      return this.heldKeys(from, to);
    }
    @Locked(['account:<0>', 'account:<1>'], { onContention: 'skip' })
    async transferOrSkip(from: string, to: string) {
      return this.heldKeys(from, to);
    }
    @Locked((from: string, to: string) => [`account:${from}`, `account:${to}`, `account:${from}`])
    async transferByFunction(from: string, to: string) {
      return this.heldKeys(from, to);
    }
    private heldKeys(from: string, to: string) {
      return [this.locks.current(`account:${from}`)?.key, this.locks.current(`account:${to}`)?.key];
    }
  }
  let redis: RedisServer;
  let moduleRef: TestingModule;
  let transfers: Transfers;
  beforeAll(async () => {
    redis = await RedisServer.start();
    @Module({ imports: [LockModule.forRoot({ redis: redis.url })], providers: [Transfers] })
    class TransfersModule {}
    moduleRef = await Test.createTestingModule({ imports: [TransfersModule] }).setLogger(new CapturingLogger()).compile();
    await moduleRef.init();
    transfers = moduleRef.get(Transfers);
  });
  afterAll(async () => {
    await moduleRef?.close();
    await redis?.stop();
  });

  it('locks every account a transfer touches', async () => {
    expect(await transfers.transfer('9', '3')).toEqual(['account:9', 'account:3']);
    const locks = moduleRef.get(LockService);
    const blocker = await locks.acquire('account:3', { owner: 'someone-else' });
    const skipped = transfers.transfer('3', '4');
    await nextEvent(locks.events$, 'contended', (e) => e.key === 'account:3');
    await blocker.release();
    expect(await skipped).toEqual(['account:3', 'account:4']);
  });

  it('skips a skipping method while another owner holds one of its keys, and names that key', async () => {
    const locks = moduleRef.get(LockService);
    const blocker = await locks.acquire('account:7', { owner: 'someone-else' });
    try {
      const skipped = nextEvent(locks.events$, 'skipped');
      expect(await transfers.transferOrSkip('6', '7')).toBeUndefined();
      expect(await skipped).toMatchObject({ key: 'account:7', method: '@Locked on Transfers.transferOrSkip' });
    } finally {
      await blocker.release();
    }
    expect(await redis.client().exists('lock:{account:6}')).toBe(0);
    expect(await transfers.transferOrSkip('6', '7')).toEqual(['account:6', 'account:7']);
  });

  it('locks every key a key function returns, and refuses a bad one among them at call time', async () => {
    expect(await transfers.transferByFunction('9', '3')).toEqual(['account:9', 'account:3']);
    await expect(transfers.transferByFunction('9', '{3}')).rejects.toThrow(
      /@Locked on Transfers\.transferByFunction \(key function\): lock key "account:\{3\}" contains "\{" or "\}"/,
    );
    expect(await redis.client().exists('lock:{account:9}', 'lock:{account:3}')).toBe(0);
  });
});
