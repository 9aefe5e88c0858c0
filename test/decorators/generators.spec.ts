import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Injectable } from '@nestjs/common';
import { Test, type TestingModule } from '@nestjs/testing';
import { filter } from 'rxjs';
import { Locked, LockConfigurationError, LockModule, LockNotAcquiredError, LockService } from '../../lib/index.js';
import { elsewhere, gate, nextEvent, nextEvents } from '../support/lock-testing.js';
import { RedisServer } from '../support/redis-server.js';

/** What the generators saw of their lock at each step, for the tests to check. */
const seen: { key?: string; holdCount?: number; locked: boolean }[] = [];

@Injectable()
class Exports {
  constructor(readonly locks: LockService) {}

  /** Yields `count` rows, each after an await, and records the lock it runs under. */
  @Locked('export:<0>')
  async *rows(name: string, count: number, onFinally?: () => Promise<void>) {
    try {
      for (let i = 1; i <= count; i++) {
        await new Promise((resolve) => setImmediate(resolve));
        const lock = this.locks.current();
        seen.push({ key: lock?.key, holdCount: lock?.holdCount, locked: await this.locks.isLocked(`export:${name}`) });
        const answer: unknown = yield { name, row: i };
        if (answer !== undefined) seen.push({ key: String(answer), locked: true });
      }
      return `${count} rows`;
    } finally {
      await onFinally?.();
    }
  }

  /** Calls another `@Locked` method on the same key from inside the generator. */
  @Locked('export:<0>')
  async *nested(name: string) {
    yield await this.count(name);
  }

  @Locked('export:<0>')
  async count(name: string) {
    return { name, holdCount: this.locks.current()?.holdCount };
  }

  @Locked('export:<0>')
  async *failing(name: string) {
    yield 1;
    throw new RangeError(`export ${name} failed`);
  }

  @Locked('export:<0>', { onContention: 'fail' })
  async *orFail(name: string) {
    yield name;
  }

  @Locked('export:<0>', { onContention: 'skip' })
  async *orSkip(name: string) {
    yield name;
  }

  @Locked('export:<0>', { leaseMs: 300, watchdog: true })
  async *shortLease(name: string) {
    yield name;
    yield name;
  }

  @Locked('export:<0>')
  async *catching(name: string) {
    try {
      yield name;
    } catch (error) {
      yield `caught ${(error as Error).message} under ${this.locks.current()?.key}`;
    }
  }
}

async function collect<T>(iterable: AsyncIterable<T>): Promise<T[]> {
  const values: T[] = [];
  for await (const value of iterable) values.push(value);
  return values;
}

describe('@Locked on an async generator method', () => {
  let redis: RedisServer;
  let moduleRef: TestingModule;
  let exports: Exports;
  let locks: LockService;
  beforeAll(async () => {
    redis = await RedisServer.start();
    moduleRef = await Test.createTestingModule({ imports: [LockModule.forRoot({ redis: redis.url, waitMs: 200 })], providers: [Exports] }).compile();
    await moduleRef.init();
    exports = moduleRef.get(Exports);
    locks = moduleRef.get(LockService);
  });
  afterAll(async () => {
    await moduleRef?.close();
    await redis?.stop();
  });

  it('returns an async generator that takes the lock at the first next(), holds it across every yield, and releases it when the method returns', async () => {
    seen.length = 0;
    const rows = exports.rows('A', 3);
    expect(typeof rows[Symbol.asyncIterator]).toBe('function');
    expect(await locks.isLocked('export:A')).toBe(false); // nothing taken until iteration starts
    const first = await rows.next();
    expect(first).toEqual({ done: false, value: { name: 'A', row: 1 } });
    // Between two items, while the caller does something else, the lock is still held.
    expect(await elsewhere(() => locks.tryAcquire('export:A'))).toBeNull();
    const released = nextEvent(locks.events$, 'released', (e) => e.key === 'export:A');
    expect(await rows.next()).toEqual({ done: false, value: { name: 'A', row: 2 } });
    expect(await rows.next()).toEqual({ done: false, value: { name: 'A', row: 3 } });
    expect(await rows.next()).toEqual({ done: true, value: '3 rows' });
    await released;
    expect(await locks.isLocked('export:A')).toBe(false);
    // Each step ran inside the lock's context, after an await of its own.
    expect(seen).toEqual([1, 2, 3].map(() => ({ key: 'export:A', holdCount: 1, locked: true })));
  });

  it('passes what the caller sends with next() and throw() to the method, still under the lock', async () => {
    seen.length = 0;
    const rows = exports.rows('B', 2);
    await rows.next();
    await rows.next('sent by the caller');
    expect(seen[1]).toEqual({ key: 'sent by the caller', locked: true });
    const catching = exports.catching('C');
    expect((await catching.next()).value).toBe('C');
    expect((await catching.throw(new Error('boom'))).value).toBe('caught boom under export:C');
    expect((await catching.next()).done).toBe(true);
    expect(await rows.return('closed by the caller')).toEqual({ done: true, value: 'closed by the caller' });
    expect(await locks.isLocked('export:B')).toBe(false);
    expect(await locks.isLocked('export:C')).toBe(false);
  });

  it("releases when the caller breaks out of for await, after the method's finally blocks ran under the lock", async () => {
    const inFinally = gate<{ locked: boolean; key?: string }>();
    const values: unknown[] = [];
    for await (const row of exports.rows('D', 10, async () => inFinally.open({ locked: await locks.isLocked('export:D'), key: locks.current()?.key }))) {
      values.push(row);
      if (values.length === 2) break;
    }
    expect(values).toHaveLength(2);
    expect(await inFinally.promise).toEqual({ locked: true, key: 'export:D' });
    expect(await locks.isLocked('export:D')).toBe(false);
  });

  it('keeps the lock of a generator the caller stopped iterating without closing it, renewed by the watchdog', async () => {
    const names = exports.shortLease('R');
    await names.next();
    // Three renewals of its 300 ms lease while nobody iterates: the lock outlives its lease.
    const renewals = await nextEvents(locks.events$.pipe(filter((e) => e.key === 'export:R')), 'renewed', 3);
    expect(renewals).toHaveLength(3);
    expect(await locks.isLocked('export:R')).toBe(true);
    expect(await names.return(undefined)).toEqual({ done: true, value: undefined });
    expect(await locks.isLocked('export:R')).toBe(false);
  });

  it('re-enters when the generator calls another @Locked method with the same key', async () => {
    expect(await collect(exports.nested('E'))).toEqual([{ name: 'E', holdCount: 2 }]);
    expect(await locks.isLocked('export:E')).toBe(false);
  });

  it("makes the caller's own @Locked call on the same key, between two items, wait for the generator's lock; taken around the loop, the lock is re-entered by both", async () => {
    // The body of the caller's for await runs in the caller's context, not the lock's: another owner.
    const between: unknown[] = [];
    for await (const _row of exports.rows('J', 1)) between.push(await exports.count('J').catch((error: unknown) => error));
    expect(between).toHaveLength(1);
    expect(between[0]).toBeInstanceOf(LockNotAcquiredError); // after waitMs (200 ms)
    // With the lock taken around the loop, the generator and the call in the loop's body re-enter it.
    const inside = await locks.run('export:J', async () => {
      const counts: unknown[] = [];
      for await (const _row of exports.rows('J', 1)) counts.push(await exports.count('J'));
      return counts;
    });
    expect(inside).toEqual([{ name: 'J', holdCount: 3 }]);
    expect(await locks.isLocked('export:J')).toBe(false);
  });

  it("passes the method's error to the caller unchanged and releases", async () => {
    const failing = exports.failing('F');
    expect((await failing.next()).value).toBe(1);
    await expect(failing.next()).rejects.toThrow(new RangeError('export F failed'));
    expect(await locks.isLocked('export:F')).toBe(false);
  });

  it("applies the contention policy at the first next(): the wait's LockNotAcquiredError, 'fail' at once, 'skip' yields nothing", async () => {
    const holder = await elsewhere(() => locks.acquire(['export:G', 'export:H', 'export:I']));
    try {
      await expect(exports.rows('G', 1).next()).rejects.toBeInstanceOf(LockNotAcquiredError); // after waitMs (200 ms)
      await expect(exports.orFail('H').next()).rejects.toMatchObject({ name: 'LockNotAcquiredError', reason: 'contended' });
      const skipped = nextEvent(locks.events$, 'skipped', (e) => e.key === 'export:I');
      expect(await collect(exports.orSkip('I'))).toEqual([]);
      await skipped;
    } finally {
      await holder.release();
    }
    expect(await collect(exports.orSkip('I'))).toEqual(['I']);
  });

  it('fails at the first next() with what to fix when the instance was not created by Nest', async () => {
    const orphan = new Exports(locks);
    await expect(orphan.orFail('X').next()).rejects.toThrow(LockConfigurationError);
    await expect(collect(orphan.orFail('X'))).rejects.toThrow(/no LockService on this instance/);
  });

  it('is refused on a (synchronous) generator method when the class is defined, saying to make it async', () => {
    const define = () => {
      class Rows {
        @Locked('rows')
        *all() {
          yield 1;
        }
      }
      return Rows;
    };
    expect(define).toThrow(LockConfigurationError);
    expect(define).toThrow('@Locked on Rows.all: a generator method runs its body only as it is iterated, after the call has returned');
    expect(define).toThrow(/Make it an async generator \(async \*all\(\)\)/);
  });
});
