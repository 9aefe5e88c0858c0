import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Injectable, Module } from '@nestjs/common';
import { Test, type TestingModule } from '@nestjs/testing';
import type { Redis } from 'ioredis';
import { performance } from 'node:perf_hooks';
import { firstValueFrom, isObservable, lastValueFrom, Observable, Observable as RxObservable, Subject, toArray } from 'rxjs';
import { LockBackendError, Locked, LockConfigurationError, LockKeyError, LockModule, LockNotAcquiredError, LockService, type LockEvent, type LockHandle } from '../../lib/index.js';
import { asleep, bootstrapFailure, CapturingLogger, elsewhere, gate, nextEvent, startLockApp, within, type LockApp } from '../support/lock-testing.js';
import { RedisServer, until } from '../support/redis-server.js';

/**
 * How much longer than minHoldMs from the call a lease left at shutdown may read: Redis counts it
 * from when it ran the command that set it, up to a round trip after it was sent on a loaded
 * machine (CI once read 27 ms past a 20 ms slack).
 */
const SLACK_MS = 200;

const feeds = new Map<string, Subject<number>>();
const feed = new Subject<number>();
feeds.set('F1', feed);
feeds.set('F2', new Subject<number>());
feeds.set('F3', new Subject<number>());
feeds.set('F4', new Subject<number>());
feeds.set('F5', new Subject<number>());
feeds.set('F7', new Subject<number>());
/** The Observable class of another copy of rxjs (a second install): not rxjs's own class, but named Observable. */
const OtherObservable = (() => {
  class Observable<T> extends RxObservable<T> {}
  return Observable;
})();
type OtherObservable<T> = RxObservable<T>;
/**
 * The Observable of a library that does not know rxjs 7's Subscriber (rxjs 6 is one): it wraps
 * the observer it is given, so unsubscribing on rxjs's side does not reach it; only the
 * unsubscribe() of the subscription it returns stops its producer.
 */
const ForeignObservable = (() => {
  class Observable {
    constructor(private readonly produce: (next: (value: number) => void) => () => void) {}
    lift(): never {
      throw new Error('not used');
    }
    subscribe(observer: { next?: (value: number) => void }) {
      return { unsubscribe: this.produce((value) => observer.next?.(value)) };
    }
  }
  return Observable;
})();
type ForeignObservable = InstanceType<typeof ForeignObservable>;
/** What the producers of ForeignObservable streams did, and when each lock was released. */
const foreignLog: string[] = [];
const foreignStream = (name: string) =>
  new ForeignObservable((next) => {
    foreignLog.push(`${name} started`);
    next(1);
    return () => foreignLog.push(`${name} stopped`);
  });
let onFeedSubscribed: (() => void) | undefined;
let calls = 0;

@Injectable()
class Ledger {
  constructor(readonly locks: LockService) {}

  @Locked('ledger:<0>')
  async post(account: string, entered?: () => void, until?: Promise<void>) {
    calls++;
    entered?.();
    await until;
    return { account, holdCount: this.locks.current()?.holdCount };
  }

  @Locked('ledger:<0>')
  async postTwice(account: string) {
    const inner = await this.post(account);
    const viaService = await this.locks.run(`ledger:${account}`, async (h) => h.holdCount);
    return { inner: inner.holdCount, viaService };
  }

  @Locked('ledger:<0>')
  async fails(account: string) {
    throw new RangeError(`no account ${account}`);
  }

  @Locked((order: { region: string; id: number }) => `order:${order.region}:${order.id}`)
  async ship(order: { region: string; id: number }) {
    return this.locks.current()?.key;
  }

  /** The ledger's own book, which a key function reads through `this`. */
  readonly book = 'eu-book';

  @Locked(function (this: Ledger, account: string) {
    return `${this.book}:${account}`;
  })
  async postToBook(account: string) {
    return this.locks.current()?.key;
  }

  @Locked('report:<0>', { onContention: 'skip' })
  async report(day: string) {
    return `report ${day}`;
  }

  @Locked('quick:<0>', { minHoldMs: 1_500, onContention: 'skip' })
  async quickJob(name: string) {
    return name;
  }

  /** Gives its lock back early, then takes the key again in the same context, and returns that hold. */
  @Locked('early:<0>', { minHoldMs: 60_000 })
  async releaseEarlyAndRetake(name: string) {
    await this.locks.current()!.release();
    return this.locks.acquire(`early:${name}`);
  }

  /** Its lock is taken from under it (`drop` deletes it in Redis) before it returns. */
  @Locked('vanish:<0>', { minHoldMs: 60_000 })
  async loseUnnoticed(name: string, drop: () => Promise<unknown>) {
    await drop();
    return name;
  }

  @Locked('sync:<0>')
  failAtOnce(name: string): string {
    throw new Error(`refused ${name}`);
  }

  @Locked('feed:<0>', { waitMs: 30_000 })
  watchPatiently(name: string): Observable<number> {
    return new Observable<number>((subscriber) => feeds.get(name)!.subscribe(subscriber));
  }

  // No return type written: TypeScript records none, so @Locked cannot know an Observable comes back.
  @Locked('feed:<0>')
  watchUndeclared(name: string) {
    return new Observable<number>((subscriber) => feeds.get(name)!.subscribe(subscriber));
  }

  @Locked('feed:<0>')
  watchOtherCopy(name: string): OtherObservable<number> {
    return new OtherObservable<number>((subscriber) => feeds.get(name)!.subscribe(subscriber));
  }

  /** The method and its subscribe function read the lock they run under; the latter re-enters it. */
  @Locked('feed:<0>')
  watchInside(name: string): Observable<{ atCall?: string; key?: string; nested: number }> {
    const atCall = this.locks.current()?.key;
    return new Observable((subscriber) => {
      const key = this.locks.current()?.key;
      this.locks.run(`feed:${name}`, async (inner) => inner.holdCount, { waitMs: 0 }).then(
        (nested) => {
          subscriber.next({ atCall, key, nested });
          subscriber.complete();
        },
        (error: unknown) => subscriber.error(error),
      );
    });
  }

  @Locked('feed:<0>', { onContention: 'skip' })
  watchOrSkip(name: string): Observable<string> {
    return new Observable<string>((subscriber) => {
      subscriber.next(name);
      subscriber.complete();
    });
  }

  @Locked('feed:<0>')
  watchFailing(name: string): Observable<number> {
    throw new RangeError(`no feed ${name}`);
  }

  /** Declares an Observable, but returns what `result` gives: a Promise or a plain value. */
  @Locked('feed:<0>')
  watchNotObservable(name: string, result: () => unknown): Observable<string> {
    return result() as Observable<string>;
  }

  @Locked('feed:<0>')
  watchForeign(name: string): ForeignObservable {
    return foreignStream(name);
  }

  // No return type written: the Promise of a foreign Observable.
  @Locked('feed:<0>')
  watchForeignUndeclared(name: string) {
    return foreignStream(name);
  }

  @Locked('feed:<0>')
  watch(name: string): Observable<number> {
    return new Observable<number>((subscriber) => {
      onFeedSubscribed?.();
      return feeds.get(name)!.subscribe(subscriber);
    });
  }
}

describe('@Locked on provider methods called directly', () => {
  let redis: RedisServer;
  let raw: Redis;
  let moduleRef: TestingModule;
  let ledger: Ledger;
  let locks: LockService;
  let logger: CapturingLogger;
  beforeAll(async () => {
    redis = await RedisServer.start();
    raw = redis.client();
    logger = new CapturingLogger();
    moduleRef = await Test.createTestingModule({
      imports: [LockModule.forRoot({ redis: redis.url, waitMs: 200 })],
      providers: [Ledger],
    })
      .setLogger(logger)
      .compile();
    await moduleRef.init();
    ledger = moduleRef.get(Ledger);
    locks = moduleRef.get(LockService);
  });
  afterAll(async () => {
    await moduleRef?.close();
    await redis?.stop();
  });

  it('holds the lock for the whole call; another owner waits, then times out', async () => {
    const entered = gate();
    const finish = gate();
    const call = ledger.post('A', entered.open, finish.promise);
    await entered.promise;
    expect(await locks.isLocked('ledger:A')).toBe(true);
    await expect(locks.acquire('ledger:A', { waitMs: 50 })).rejects.toBeInstanceOf(LockNotAcquiredError);
    finish.open();
    expect(await call).toEqual({ account: 'A', holdCount: 1 });
    expect(await locks.isLocked('ledger:A')).toBe(false);
  });

  it('re-enters when a locked method calls another locked method or LockService with the same key', async () => {
    expect(await ledger.postTwice('B')).toEqual({ inner: 2, viaService: 2 });
    expect(await locks.isLocked('ledger:B')).toBe(false);
  });

  it('rethrows the method\'s error unchanged and releases', async () => {
    await expect(ledger.fails('C')).rejects.toThrow(new RangeError('no account C'));
    expect(await locks.isLocked('ledger:C')).toBe(false);
  });

  it('takes the key from a key function', async () => {
    expect(await ledger.ship({ region: 'eu', id: 5 })).toBe('order:eu:5');
  });

  it("refuses a key function's key that cannot be a lock key before Redis, naming the method", async () => {
    const failure = await ledger.ship({ region: 'eu{1}', id: 5 }).catch((e: unknown) => e);
    expect(failure).toBeInstanceOf(LockKeyError);
    expect((failure as Error).message).toMatch(/^@Locked on Ledger\.ship \(key function\): lock key "order:eu\{1\}:5" contains "\{" or "\}"/);
  });

  it('calls a key function written with function with the instance as this', async () => {
    expect(await ledger.postToBook('A7')).toBe('eu-book:A7');
  });

  it('skips the method when another owner holds the lock, returning undefined and logging at debug', async () => {
    const holder = await locks.acquire('report:2026-11-22');
    const skipped = nextEvent(locks.events$, 'skipped');
    const before = calls;
    expect(await ledger.report('2026-11-22')).toBeUndefined();
    expect(await skipped).toMatchObject({ key: 'report:2026-11-22', method: '@Locked on Ledger.report' });
    expect(logger.at('debug')).toContainEqual(expect.stringContaining('skipped: "report:2026-11-22" is held by another owner'));
    expect(calls).toBe(before);
    await holder.release();
    expect(await ledger.report('2026-11-22')).toBe('report 2026-11-22');
  });

  it('keeps the lock until minHoldMs after it was taken, then lets Redis expire it', async () => {
    await raw.config('SET', 'notify-keyspace-events', 'Ex');
    const sub = redis.client();
    const expired = new Promise<number>((resolve) => sub.on('message', (_c: string, key: string) => key === 'lock:{quick:q1}' && resolve(performance.now())));
    await sub.subscribe('__keyevent@0__:expired');
    const started = performance.now();
    expect(await ledger.quickJob('q1')).toBe('q1');
    const ttl = await raw.pttl('lock:{quick:q1}');
    expect(ttl).toBeGreaterThan(1_000);
    expect(ttl).toBeLessThanOrEqual(1_500);
    // A second trigger of the same job (another instance, a little late) skips.
    expect(await locks.tryAcquire('quick:q1')).toBeNull();
    expect(await ledger.quickJob('q1')).toBeUndefined();
    expect((await expired) - started).toBeGreaterThanOrEqual(1_400);
    expect(await ledger.quickJob('q1')).toBe('q1');
  });

  it('keeps nothing for minHoldMs once the method released its own lock, and leaves alone the hold it took again after', async () => {
    const events: string[] = [];
    const watching = locks.events$.subscribe((e) => e.key === 'early:e1' && events.push(e.type));
    const retaken = await ledger.releaseEarlyAndRetake('e1');
    watching.unsubscribe();
    try {
      // The method's own release, then its new hold (its context held nothing any more: a new
      // owner): the call's end sent no second release, which would report the lock lost.
      expect(events).toEqual(['acquired', 'released', 'acquired']);
      // The hold taken after the early release is intact.
      expect(retaken.holdCount).toBe(1);
      expect(await locks.holdCount('early:e1', { owner: retaken.owner })).toBe(1);
      // Under the watchdog's lease (renewed), not left as a fixed 60 s lease by minHoldMs.
      const ttl = await raw.pttl('lock:{early:e1}');
      expect(ttl).toBeGreaterThan(0);
      expect(ttl).toBeLessThanOrEqual(locks.settings.leaseMs);
    } finally {
      await retaken.release();
    }
    // Its release was the last hold: nothing of minHoldMs's 60 s is left.
    expect(await raw.exists('lock:{early:e1}')).toBe(0);
  });

  it('reports a lock lost under a minHoldMs method when the call ends, instead of keeping it for minHoldMs', async () => {
    const events: LockEvent[] = [];
    const watching = locks.events$.subscribe((e) => e.key === 'vanish:v1' && events.push(e));
    expect(await ledger.loseUnnoticed('v1', () => raw.del('lock:{vanish:v1}'))).toBe('v1');
    watching.unsubscribe();
    expect(events.map((e) => e.type)).toEqual(['acquired', 'lost']);
    expect(events[1]).toMatchObject({ reason: 'taken' });
    expect(await raw.exists('lock:{vanish:v1}')).toBe(0);
  });

  it('releases the lock of a method that throws before returning (not async), and rejects with its error', async () => {
    await expect(ledger.failAtOnce('S1')).rejects.toThrow('refused S1');
    expect(await locks.isLocked('sync:S1')).toBe(false);
  });

  it('takes the lock of a declared Observable on subscribe and holds it until completion', async () => {
    const stream = ledger.watch('F1');
    expect(await locks.isLocked('feed:F1')).toBe(false); // nothing until subscribed
    const subscribed = gate();
    onFeedSubscribed = subscribed.open;
    const values = firstValueFrom(stream.pipe(toArray()));
    await subscribed.promise;
    feed.next(1);
    feed.next(2);
    expect(await locks.isLocked('feed:F1')).toBe(true);
    const released = nextEvent(locks.events$, 'released', (e) => e.key === 'feed:F1');
    feed.complete();
    expect(await values).toEqual([1, 2]);
    await released;
    expect(await locks.isLocked('feed:F1')).toBe(false);
  });

  it('recognises a declared Observable of another copy of rxjs by its class name: its lock is taken on subscribe', async () => {
    const stream = ledger.watchOtherCopy('F7');
    expect(isObservable(stream)).toBe(true); // not a Promise
    expect(await locks.isLocked('feed:F7')).toBe(false);
    const values = firstValueFrom(stream.pipe(toArray()));
    await until(async () => locks.isLocked('feed:F7'), 5_000, 'never locked on subscribe');
    const released = nextEvent(locks.events$, 'released', (e) => e.key === 'feed:F7');
    feeds.get('F7')!.next(3);
    feeds.get('F7')!.complete();
    expect(await values).toEqual([3]);
    await released;
  });

  it("calls a declared Observable's method and subscribes to its Observable inside the lock: both see it, and a locked call from the subscribe function re-enters", async () => {
    expect(await within(firstValueFrom(ledger.watchInside('F8')), 5_000)).toEqual({ atCall: 'feed:F8', key: 'feed:F8', nested: 2 });
    await until(async () => !(await locks.isLocked('feed:F8')), 5_000, 'the lock was never released');
  });

  it('completes a skipped Observable without a value', async () => {
    const other = await elsewhere(() => locks.acquire('feed:F9'));
    try {
      expect(await within(firstValueFrom(ledger.watchOrSkip('F9'), { defaultValue: 'skipped' }), 5_000)).toBe('skipped');
    } finally {
      await other.release();
    }
    expect(await within(firstValueFrom(ledger.watchOrSkip('F9')), 5_000)).toBe('F9');
  });

  it('turns what a method that declares an Observable returns instead (a Promise, a value) into one value and completes, then releases', async () => {
    for (const [name, result] of [
      ['F11', () => Promise.resolve('from a Promise')],
      ['F12', () => 'a plain value'],
    ] as const) {
      const released = nextEvent(locks.events$, 'released', (e) => e.key === `feed:${name}`);
      expect(await within(lastValueFrom(ledger.watchNotObservable(name, result).pipe(toArray())), 5_000)).toEqual([await result()]);
      await released;
    }
    const released = nextEvent(locks.events$, 'released', (e) => e.key === 'feed:F13');
    await expect(within(lastValueFrom(ledger.watchNotObservable('F13', () => Promise.reject(new RangeError('no feed F13')))), 5_000)).rejects.toThrow('no feed F13');
    await released;
  });

  it("errors a declared Observable whose lock another owner holds past the wait, with the wait's LockNotAcquiredError", async () => {
    const other = await elsewhere(() => locks.acquire('feed:F14'));
    try {
      const failure = await within(firstValueFrom(ledger.watch('F14')).catch((e: unknown) => e), 5_000);
      expect(failure).toBeInstanceOf(LockNotAcquiredError);
      expect(failure).toMatchObject({ key: 'feed:F14' });
    } finally {
      await other.release();
    }
  });

  it("stops another library's Observable before giving its lock back when the subscriber leaves, declared or not", async () => {
    foreignLog.length = 0;
    const watching = locks.events$.subscribe((e) => e.type === 'released' && e.key.startsWith('feed:F15') && foreignLog.push(`${e.key} released`));
    try {
      const declared = ledger.watchForeign('F15a');
      const undeclared = (await ledger.watchForeignUndeclared('F15b')) as unknown as Observable<number>;
      for (const [name, stream] of [['F15a', declared], ['F15b', undeclared]] as const) {
        const first = gate();
        const subscription = stream.subscribe(() => first.open());
        await first.promise;
        const released = nextEvent(locks.events$, 'released', (e) => e.key === `feed:${name}`);
        subscription.unsubscribe();
        await released;
      }
    } finally {
      watching.unsubscribe();
    }
    expect(foreignLog).toEqual(['F15a started', 'F15a stopped', 'feed:F15a released', 'F15b started', 'F15b stopped', 'feed:F15b released']);
  });

  it('errors a declared Observable whose method throws at once, and releases its lock', async () => {
    const released = nextEvent(locks.events$, 'released', (e) => e.key === 'feed:F10');
    await expect(within(firstValueFrom(ledger.watchFailing('F10')), 5_000)).rejects.toThrow('no feed F10');
    await released;
    expect(await locks.isLocked('feed:F10')).toBe(false);
  });

  it('releases an Observable\'s lock when the subscriber unsubscribes', async () => {
    const subscribed = gate();
    onFeedSubscribed = subscribed.open;
    const subscription = ledger.watch('F2').subscribe();
    await subscribed.promise;
    expect(await locks.isLocked('feed:F2')).toBe(true);
    const released = nextEvent(locks.events$, 'released', (e) => e.key === 'feed:F2');
    subscription.unsubscribe();
    await released;
    expect(await locks.isLocked('feed:F2')).toBe(false);
  });

  it("gives back an Observable's lock granted after its subscriber left (the attempt was on its way), without running the method", async () => {
    let ran = false;
    onFeedSubscribed = () => (ran = true);
    const acquired = nextEvent(locks.events$, 'acquired', (e) => e.key === 'feed:F6');
    const released = nextEvent(locks.events$, 'released', (e) => e.key === 'feed:F6');
    ledger.watch('F6').subscribe().unsubscribe(); // the attempt was sent inside subscribe()
    await acquired;
    await released;
    expect(ran).toBe(false);
    expect(await locks.isLocked('feed:F6')).toBe(false);
  });

  it('holds the lock of an Observable the method does not declare from the call until it ends, and warns once per method', async () => {
    const warnings = logger.at('warn').length;
    const consume = async (name: string) => {
      const call = ledger.watchUndeclared(name);
      expect(call).toBeInstanceOf(Promise);
      const source = (await call) as Observable<number>;
      expect(isObservable(source)).toBe(true);
      // Taken at the call, before anyone subscribed.
      expect(await locks.isLocked(`feed:${name}`)).toBe(true);
      const values = firstValueFrom(source.pipe(toArray()));
      const released = nextEvent(locks.events$, 'released', (e) => e.key === `feed:${name}`);
      feeds.get(name)!.next(7);
      expect(await locks.isLocked(`feed:${name}`)).toBe(true);
      feeds.get(name)!.complete();
      expect(await values).toEqual([7]);
      await released;
      expect(await locks.isLocked(`feed:${name}`)).toBe(false);
    };
    await consume('F4');
    await consume('F5');
    expect(logger.at('warn').slice(warnings)).toEqual([expect.stringContaining('Ledger.watchUndeclared returned an Observable without declaring it')]);
  });

  it("stops waiting for an Observable's lock when the subscriber unsubscribes before it was granted", async () => {
    const waitState = () => (locks as unknown as { store: { waitState: { channels: number; waiters: number } } }).store.waitState;
    const holder = await elsewhere(() => locks.acquire('feed:F3'));
    const contended = nextEvent(locks.events$, 'contended', (e) => e.key === 'feed:F3');
    const subscription = ledger.watchPatiently('F3').subscribe();
    await contended;
    expect(waitState().waiters).toBe(1); // waiting up to 30 s
    subscription.unsubscribe();
    await until(async () => waitState().waiters === 0, 5_000, 'the wait went on after its subscriber left');
    await holder.release();
    expect(await locks.isLocked('feed:F3')).toBe(false);
  });

  it('explains the missing LockService when the instance was not created by Nest', async () => {
    const orphan = new Ledger(locks);
    await expect(orphan.post('X')).rejects.toThrow(LockConfigurationError);
    await expect(orphan.post('X')).rejects.toThrow(/no LockService on this instance.*created by Nest/);
  });

  it('explains a call without the instance (a method passed on as a callback) instead of blaming Nest', async () => {
    const { post } = ledger;
    const failure = await post('X').then(() => new Error('ran'), (e: unknown) => e);
    expect(failure).toBeInstanceOf(LockConfigurationError);
    expect((failure as Error).message).toMatch(/@Locked on Ledger\.post: called without its instance \(this is undefined\).*Bind it \(this\.post\.bind\(this\)\)/);
    expect(await locks.isLocked('ledger:X')).toBe(false);
    // Called back by a timer: `this` is Node's Timeout.
    const calledBack = new Promise<unknown>((resolve) => {
      setTimeout(function (this: unknown) {
        resolve(post.call(this as Ledger, 'X').then(() => new Error('ran'), (e: unknown) => e));
      }, 0);
    });
    expect(String(await calledBack)).toMatch(/called without its instance \(this is an object \(Timeout\)\)/);
  });
});

describe('@Locked in a module that cannot inject LockService', () => {
  @Injectable()
  class Feature {
    @Locked('feature:<0>')
    async run(id: string) {
      return id;
    }
  }

  it('fails bootstrap, naming LockService and the module to import it into', async () => {
    // LockModule is imported by the root module but not made global, and the feature module does not import it.
    @Module({ providers: [Feature] })
    class FeatureModule {}
    const failure = await bootstrapFailure(() =>
      Test.createTestingModule({ imports: [LockModule.forRoot({ redis: 'redis://127.0.0.1:1', connectTimeoutMs: 0 }), FeatureModule] })
        .setLogger(new CapturingLogger())
        .compile(),
    );
    expect(failure).toBeInstanceOf(Error);
    expect((failure as Error).message).toMatch(/can't resolve dependencies of the Feature/);
    expect((failure as Error).message).toMatch(/nestjs-locked:lock-service/);
    expect((failure as Error).message).toMatch(/If LockService is exported from a separate @Module, is that module imported within FeatureModule\?/);
  });
});

describe("@Locked under the module's onContention and minHoldMs", () => {
  @Injectable()
  class Jobs {
    @Locked('job:<0>')
    async run(id: string) {
      return `ran ${id}`;
    }

    @Locked('doc:<0>', { mode: 'read' })
    async read(id: string) {
      return `read ${id}`;
    }
  }

  it("leaves nothing of a read method's hold after the call: minHoldMs keeps exclusive and write locks only", async () => {
    // Redis keeps one lease for all the readers of a key: a read hold kept for minHoldMs stayed as
    // long as the other readers kept the lock alive, and kept writers out after they left.
    const redis = await RedisServer.start();
    const app = await startLockApp({ redis: redis.url, minHoldMs: 5_000 }, [Jobs]);
    try {
      const other = await elsewhere(() => app.locks.readLock('doc:1', { leaseMs: 30_000 }));
      expect(await app.moduleRef.get(Jobs).read('1')).toBe('read 1');
      expect(Object.keys(await redis.client().hgetall('lock:{doc:1}'))).toEqual([':mode', `${other.owner}:read`]);
      await other.release();
      expect(await app.locks.isLocked('doc:1')).toBe(false);
    } finally {
      await app.close();
      await redis.stop();
    }
  });
  it('applies them to a @Locked method that sets neither: the lock stays after the call, and a second call skips at once', async () => {
    const redis = await RedisServer.start();
    const app = await startLockApp({ redis: redis.url, onContention: 'skip', minHoldMs: 5_000, waitMs: 60_000 }, [Jobs]);
    try {
      const jobs = app.moduleRef.get(Jobs);
      expect(await jobs.run('1')).toBe('ran 1');
      // minHoldMs: still held for up to 5 s after the call, with no renewal.
      expect(await redis.client().pttl('lock:{job:1}')).toBeGreaterThan(3_000);
      // onContention 'skip': the module's 60 s wait does not apply; the call returns at once.
      expect(await within(elsewhere(() => jobs.run('1')), 3_000)).toBeUndefined();
    } finally {
      await app.close();
      await redis.stop();
    }
  });

  it('fails a skipping method whose Redis does not answer with LockBackendError: an outage is not contention', async () => {
    const redis = await RedisServer.start();
    const app = await startLockApp({ redis: redis.url, onContention: 'skip', stepTimeoutMs: 250 }, [Jobs]);
    const skipped: LockEvent[] = [];
    const watching = app.locks.events$.subscribe((e) => e.type === 'skipped' && skipped.push(e));
    try {
      redis.pause();
      const failure = await within(app.moduleRef.get(Jobs).run('2').catch((e: unknown) => e), 5_000).finally(() => redis.resume());
      expect(failure).toBeInstanceOf(LockBackendError);
      expect(skipped).toEqual([]);
    } finally {
      watching.unsubscribe();
      await app.close();
      await redis.stop();
    }
  });
});

describe('minHoldMs on a write method whose owner still reads the lock (a downgrade)', () => {
  @Injectable()
  class Docs {
    constructor(readonly locks: LockService) {}

    /** Rewrites, then keeps reading: returns a read hold of the same owner that outlives the call. */
    @Locked('doc:<0>', { mode: 'write', minHoldMs: 1_000 })
    async rewriteThenRead(id: string) {
      return this.locks.readLock(`doc:${id}`);
    }

    @Locked('doc:<0>', { mode: 'write', minHoldMs: 1_000 })
    async rewrite(id: string) {
      return id;
    }

    @Locked('page:<0>', { mode: 'write', minHoldMs: 20_000 })
    async rewritePageThenRead(id: string) {
      return this.locks.readLock(`page:${id}`);
    }

    @Locked('page:<0>', { mode: 'write', minHoldMs: 20_000 })
    async rewritePage(id: string) {
      return id;
    }

    /** A plain lock, whose owner then reads it (a plain lock is not downgraded: see the README). */
    @Locked('plain:<0>', { minHoldMs: 500 })
    async lockThenRead(id: string) {
      return this.locks.readLock(`plain:${id}`);
    }
  }

  /** How the owner of the kept write hold comes to read `doc:1`: the read handle it ends up with. */
  const downgrades: Record<string, (app: LockApp) => Promise<LockHandle>> = {
    'the method returns a read handle of its own key': (app) => app.moduleRef.get(Docs).rewriteThenRead('1'),
    // The method runs in the job's context, so its owner is the job's, which then reads the key.
    'the job that called the method reads the key after it': (app) =>
      app.locks.run('jobs:hourly', async () => {
        expect(await app.moduleRef.get(Docs).rewrite('1')).toBe('1');
        return app.locks.readLock('doc:1');
      }),
  };

  // Redis keeps one lease for both sides, renewed by the read side: the write hold kept for
  // minHoldMs stayed as long as the read side was held, keeping every other reader out.
  it.each((['redis', 'memory'] as const).flatMap((store) => Object.keys(downgrades).map((way) => [store, way] as const)))(
    'keeps other readers out until minHoldMs is up, then lets them in beside the read side (%s store; %s)',
    async (store, way) => {
      const redis = store === 'redis' ? await RedisServer.start() : undefined;
      const app = await startLockApp(redis ? { redis: redis.url } : { store: 'memory' }, [Docs]);
      try {
        const started = performance.now();
        const read = await downgrades[way]!(app);
        await expect(elsewhere(() => app.locks.readLock('doc:1', { waitMs: 0 }))).rejects.toBeInstanceOf(LockNotAcquiredError);
        // Woken by the release of the kept write hold (before, this reader gave up after 5 s).
        const other = await elsewhere(() => app.locks.readLock('doc:1', { waitMs: 5_000 }));
        expect(performance.now() - started).toBeGreaterThanOrEqual(950);
        expect(await app.locks.holdCount('doc:1', { owner: read.owner, mode: 'read' })).toBe(1);
        await other.release();
        await read.release();
        expect(await app.locks.isLocked('doc:1')).toBe(false);
      } finally {
        await app.close();
        await redis?.stop();
      }
    },
  );

  // The plain hold kept for minHoldMs stayed on the read side's lease, renewed, and its lease
  // after: the lock stayed taken after the read side's release.
  it.each(['redis', 'memory'] as const)(
    "gives a plain lock's kept hold back too, so the lock is free as soon as the owner's read side goes (%s store)",
    async (store) => {
      const redis = store === 'redis' ? await RedisServer.start() : undefined;
      const app = await startLockApp(redis ? { redis: redis.url } : { store: 'memory' }, [Docs]);
      try {
        const read = await app.moduleRef.get(Docs).lockThenRead('1');
        await until(async () => (await app.locks.holdCount('plain:1', { owner: read.owner })) === 0, 5_000, 'the plain hold given back');
        // The read side alone still keeps every other owner out.
        expect(await elsewhere(() => app.locks.tryAcquire('plain:1', { mode: 'read' }))).toBeNull();
        await read.release();
        const other = await elsewhere(() => app.locks.tryAcquire('plain:1'));
        expect(other).not.toBeNull();
        await other!.release();
      } finally {
        await app.close();
        await redis?.stop();
      }
    },
  );

  it('leaves kept write holds alone in Redis for the rest of minHoldMs when the app shuts down', async () => {
    const redis = await RedisServer.start();
    const raw = redis.client();
    const app = await startLockApp({ redis: redis.url }, [Docs]);
    try {
      expect(await app.moduleRef.get(Docs).rewritePage('2')).toBe('2');
      const read = await app.moduleRef.get(Docs).rewritePageThenRead('1');
      const returned = performance.now();
      await app.close();
      // Shutdown took the read side back; the write hold stays alone, on what is left of its 20 s
      // (before, on the read side's 30 s lease). Redis counts a lease from when it ran the command
      // that set it, a little after it was sent: SLACK_MS.
      expect(Object.keys(await raw.hgetall('lock:{page:1}'))).toEqual([read.owner]);
      for (const key of ['lock:{page:1}', 'lock:{page:2}']) {
        const asked = performance.now();
        const ttl = await raw.pttl(key);
        expect(ttl).toBeGreaterThan(0);
        expect(ttl).toBeLessThanOrEqual(20_000 - (asked - returned) + SLACK_MS);
      }
    } finally {
      await app.close();
      await redis.stop();
    }
  });
});

describe('minHoldMs when the app shuts down during the call', () => {
  @Injectable()
  class Jobs {
    constructor(readonly locks: LockService) {}

    @Locked('jobs:long', { minHoldMs: 20_000 })
    async long(entered: (signal: AbortSignal) => void, finish: Promise<void>) {
      entered(this.locks.current()!.signal);
      await finish;
    }

    @Locked(['jobs:a', 'jobs:b'], { minHoldMs: 20_000 })
    async both(entered: () => void, finish: Promise<void>) {
      entered();
      await finish;
    }

    @Locked('jobs:short', { minHoldMs: 300 })
    async short(entered: () => void, finish: Promise<void>) {
      entered();
      await finish;
    }

    @Locked('doc:<0>', { mode: 'write', minHoldMs: 20_000 })
    async rewrite(id: string) {
      return id;
    }

    @Locked('jobs:named', { minHoldMs: 20_000 })
    async named(entered: () => void, finish: Promise<void>) {
      entered();
      await finish;
    }
  }

  /**
   * The lease Redis has left on `key`, checked against minHoldMs (20 s) counted from `taken`. Redis
   * counts the lease shutdown set from when it ran that command, a little after it was sent: up to
   * SLACK_MS more, far less than the test's 1 s between `taken` and shutdown, which a lease counted
   * from shutdown would add.
   */
  async function leftOfMinHold(raw: Redis, key: string, taken: number): Promise<void> {
    const asked = performance.now();
    const ttl = await raw.pttl(key);
    expect(ttl).toBeGreaterThan(15_000);
    expect(ttl).toBeLessThanOrEqual(20_000 - (asked - taken) + SLACK_MS);
  }

  // Before, shutdown took every lock still held back, so another instance whose trigger fired a
  // little late ran the same tick again while the job that held it had only just begun.
  it('leaves the lock in Redis until minHoldMs after it was taken, and releases one taken longer ago than that', async () => {
    const redis = await RedisServer.start();
    const raw = redis.client();
    const app = await startLockApp({ redis: redis.url }, [Jobs]);
    const jobs = app.moduleRef.get(Jobs);
    const finish = gate();
    try {
      const [long, both, short] = [gate(), gate(), gate()];
      let signal: AbortSignal | undefined;
      const calls = [
        jobs.long((s) => {
          signal = s;
          long.open();
        }, finish.promise),
        jobs.both(both.open, finish.promise),
        jobs.short(short.open, finish.promise),
      ];
      await Promise.all([long.promise, both.promise, short.promise]);
      const taken = performance.now();
      // Past jobs:short's minHoldMs, and far enough from `taken` that a lease counted from shutdown
      // would show (see leftOfMinHold).
      await until(async () => performance.now() - taken > 1_000, 5_000, '1 s');
      await app.close();
      // The call is told, as for any lock at shutdown, but the lock stays for the rest of its minHoldMs.
      expect(signal?.aborted).toBe(true);
      expect(signal?.reason).toMatchObject({ reason: 'shutdown' });
      for (const key of ['lock:{jobs:long}', 'lock:{jobs:a}', 'lock:{jobs:b}']) await leftOfMinHold(raw, key, taken);
      expect(await raw.exists('lock:{jobs:short}')).toBe(0);
      finish.open();
      await Promise.allSettled(calls);
      // The call's end, after shutdown, leaves the lock as it was.
      await leftOfMinHold(raw, 'lock:{jobs:long}', taken);
    } finally {
      finish.open();
      await app.close();
      await redis.stop();
    }
  });

  it('leaves a lock in Redis for the rest of a hold kept for minHoldMs when its owner took it again since', async () => {
    const redis = await RedisServer.start();
    const raw = redis.client();
    const app = await startLockApp({ redis: redis.url }, [Jobs]);
    const entered = gate();
    const finish = gate();
    try {
      let taken = 0;
      const job = app.locks.run('jobs:nightly', async () => {
        expect(await app.moduleRef.get(Jobs).rewrite('3')).toBe('3');
        taken = performance.now();
        // The job takes the kept lock again (a re-entry: its owner is the job's).
        await app.locks.run(
          'doc:3',
          async (lock) => {
            expect(lock.holdCount).toBe(2);
            entered.open();
            await finish.promise;
          },
          { mode: 'write' },
        );
      });
      await entered.promise;
      await app.close();
      // Before, shutdown took back every hold of the owner, the kept one with them.
      await leftOfMinHold(raw, 'lock:{doc:3}', taken);
      finish.open();
      await job.catch(() => undefined);
    } finally {
      finish.open();
      await app.close();
      await redis.stop();
    }
  });
  it('gives back only its own holds of a lock whose owner was given by name, which another process holds too', async () => {
    const redis = await RedisServer.start();
    const raw = redis.client();
    const app = await startLockApp({ redis: redis.url }, [Jobs]);
    const other = await startLockApp({ redis: redis.url });
    const entered = gate();
    const finish = gate();
    try {
      const job = app.locks.run('jobs:named-outer', () => app.moduleRef.get(Jobs).named(entered.open, finish.promise), { owner: 'transfer-5' });
      await entered.promise;
      const handed = await other.locks.acquire('jobs:named', { owner: 'transfer-5', waitMs: 0 });
      expect(handed.holdCount).toBe(2);
      await app.close();
      // A fixed lease of the rest of minHoldMs would cut the other process's, and leave this one's hold in the count.
      expect(await raw.pttl('lock:{jobs:named}')).toBeGreaterThan(25_000);
      expect(await other.locks.holdCount('jobs:named', { owner: 'transfer-5' })).toBe(1);
      await handed.release();
      expect(await raw.exists('lock:{jobs:named}')).toBe(0);
      finish.open();
      await job.catch(() => undefined);
    } finally {
      finish.open();
      await other.close();
      await app.close();
      await redis.stop();
    }
  });
});

describe('minHoldMs under an owner given by name that another process holds the lock under too', () => {
  @Injectable()
  class Transfers {
    @Locked('transfer:<0>', { minHoldMs: 300 })
    async settle(_id: string, entered: () => void, finish: Promise<void>) {
      entered();
      await finish;
    }
  }

  // One owner, one hash field in two processes: before, the call's end set the lock's lease to the
  // rest of minHoldMs, as for a holder alone, and the lock ended under the other process.
  it("leaves the other process's lease as it is, and gives this process's hold back when minHoldMs is up", async () => {
    const redis = await RedisServer.start();
    const raw = redis.client();
    const app = await startLockApp({ redis: redis.url }, [Transfers]);
    const other = await startLockApp({ redis: redis.url });
    const entered = gate();
    const finish = gate();
    try {
      const call = app.locks.run('transfer:outer', () => app.moduleRef.get(Transfers).settle('1', entered.open, finish.promise), { owner: 'transfer-7' });
      await entered.promise;
      const handed = await other.locks.acquire('transfer:1', { owner: 'transfer-7', waitMs: 0 });
      expect(handed.holdCount).toBe(2);
      finish.open();
      await call;
      expect(await raw.pttl('lock:{transfer:1}')).toBeGreaterThan(25_000);
      // This process's hold, kept for minHoldMs, is given back by its timer; the other's stays.
      await until(async () => (await other.locks.holdCount('transfer:1', { owner: 'transfer-7' })) === 1, 5_000, 'the kept hold given back');
      expect(await raw.pttl('lock:{transfer:1}')).toBeGreaterThan(25_000);
      expect(handed.isHeld).toBe(true);
      expect(await other.locks.tryAcquire('transfer:1')).toBeNull();
      await handed.release();
      expect(await raw.exists('lock:{transfer:1}')).toBe(0);
    } finally {
      finish.open();
      await other.close();
      await app.close();
      await redis.stop();
    }
  });
});

describe('minHoldMs and the waiters of the lock it keeps', () => {
  @Injectable()
  class Imports {
    @Locked('import:<0>', { minHoldMs: 400 })
    async run(_id: string, entered: () => void, finish: Promise<void>) {
      entered();
      await finish;
    }
  }

  // A waiter sleeps until the lease it last saw ends (the holder's 30 s, renewed) unless a message
  // wakes it; the lock kept for minHoldMs ends by its lease, with no release message. Before, such
  // a waiter got the lock only when its own wait (10 s here) ran out.
  it.each(['redis', 'memory'] as const)('wakes them as the call ends, so that one gets the lock when minHoldMs is up (%s store)', async (store) => {
    const redis = store === 'redis' ? await RedisServer.start() : undefined;
    const options = redis ? { redis: redis.url } : { store: 'memory' as const };
    const app = await startLockApp(options, [Imports]);
    // On Redis, the waiter is another instance of the application.
    const waiterApp = redis ? await startLockApp(options) : app;
    try {
      const entered = gate();
      const finish = gate();
      const started = performance.now();
      const call = app.moduleRef.get(Imports).run('1', entered.open, finish.promise);
      await entered.promise;
      const waiting = elsewhere(() => waiterApp.locks.acquire('import:1', { waitMs: 10_000 }));
      // Asleep after an attempt that saw the call's lease.
      await until(async () => asleep(waiterApp, 'import:1') === 1, 5_000, 'the waiter asleep');
      finish.open();
      await call;
      const lock = await within(waiting, 5_000);
      expect(performance.now() - started).toBeGreaterThanOrEqual(380);
      await lock.release();
    } finally {
      if (waiterApp !== app) await waiterApp.close();
      await app.close();
      await redis?.stop();
    }
  });
});

describe('@Locked with a LockService a test replaced by a mock', () => {
  @Injectable()
  class Payments {
    constructor(readonly locks: LockService) {}
    @Locked('payment:<0>')
    async pay(id: string) {
      return `paid ${id}`;
    }
    @Locked('payment:<0>')
    watch(id: string): Observable<string> {
      return new Observable((s) => s.next(id));
    }
    @Locked('payment:<0>')
    async *history(id: string) {
      yield id;
    }
  }
  const says = /@Locked on Payments\.pay: the LockService injected into this instance is not nestjs-locked's LockService but a plain object: a test replaced it .*import LockTestingModule\.forRoot\(\) in the test instead of a mock/;

  it('fails each call with a LockConfigurationError that says to use LockTestingModule, for a provider { provide: LockService, useValue }', async () => {
    let calls = 0;
    const mock = { run: async (_key: string, fn: () => unknown) => (calls++, fn()), acquire: async () => (calls++, undefined) };
    const moduleRef = await Test.createTestingModule({ providers: [Payments, { provide: LockService, useValue: mock }] }).compile();
    const payments = moduleRef.get(Payments);
    await expect(payments.pay('1')).rejects.toThrow(LockConfigurationError);
    await expect(payments.pay('1')).rejects.toThrow(says);
    // Each in the shape the method returns, never the TypeError of a missing internal method.
    await expect(firstValueFrom(payments.watch('1'))).rejects.toThrow(/Payments\.watch: the LockService injected .* is not nestjs-locked's/);
    await expect(payments.history('1').next()).rejects.toThrow(/Payments\.history: the LockService injected .* is not nestjs-locked's/);
    expect(calls).toBe(0);
    await moduleRef.close();
  });

  it('fails the same way after overrideProvider(LockService).useValue(...)', async () => {
    const moduleRef = await Test.createTestingModule({ imports: [LockModule.forRoot({ store: 'memory' })], providers: [Payments] })
      .overrideProvider(LockService)
      .useValue({ run: async () => undefined })
      .compile();
    await expect(moduleRef.get(Payments).pay('1')).rejects.toThrow(says);
    await moduleRef.close();
  });

  it('names the class of a hand-written stand-in (useClass)', async () => {
    class FakeLocks {
      async run(_key: string, fn: () => unknown) {
        return fn();
      }
    }
    const moduleRef = await Test.createTestingModule({ providers: [Payments, { provide: LockService, useClass: FakeLocks }] }).compile();
    await expect(moduleRef.get(Payments).pay('1')).rejects.toThrow(/is not nestjs-locked's LockService but an instance of FakeLocks: a test replaced it/);
    await moduleRef.close();
  });

  it("fails the same way with an automatic mock from useMocker() (a Proxy whose every property is a function, as @golevelup/ts-jest's createMock makes), and names useMocker", async () => {
    let calls = 0;
    const autoMock = () =>
      new Proxy({}, { get: (_target, property) => (property === 'then' ? undefined : (..._args: unknown[]) => (calls++, undefined)) });
    const moduleRef = await Test.createTestingModule({ providers: [Payments] }).useMocker(autoMock).compile();
    const failure = await moduleRef.get(Payments).pay('1').then(() => undefined, (error: unknown) => error);
    expect(failure).toBeInstanceOf(LockConfigurationError);
    expect((failure as Error).message).toMatch(says);
    expect((failure as Error).message).toContain('useMocker()');
    expect(calls).toBe(0);
    await moduleRef.close();
  });
});

describe('@Locked with a decorator that wraps the method itself (a transaction)', () => {
  const steps: string[] = [];
  /** A transaction decorator as ORMs' helpers write them: begin, run the method, commit. */
  function Transactional(): MethodDecorator {
    return (_target, _key, descriptor) => {
      const method = descriptor.value as unknown as (...args: unknown[]) => Promise<unknown>;
      descriptor.value = async function (this: unknown, ...args: unknown[]) {
        steps.push('begin');
        const result = await method.apply(this, args);
        steps.push('commit');
        return result;
      } as never;
      return descriptor;
    };
  }
  @Injectable()
  class Accounts {
    constructor(readonly locks: LockService) {}
    @Locked('account:<0>')
    @Transactional()
    async lockedOutside(id: string) {
      steps.push(`work, hold count ${this.locks.current()?.holdCount}`);
      return id;
    }
    @Transactional()
    @Locked('account:<0>')
    async lockedInside(id: string) {
      steps.push(`work, hold count ${this.locks.current()?.holdCount}`);
      return id;
    }
  }

  let moduleRef: TestingModule;
  let accounts: Accounts;
  beforeAll(async () => {
    moduleRef = await Test.createTestingModule({ imports: [LockModule.forRoot({ store: 'memory' })], providers: [Accounts] }).compile();
    await moduleRef.init();
    accounts = moduleRef.get(Accounts);
    moduleRef.get(LockService).events$.subscribe((e) => (e.type === 'acquired' || e.type === 'released') && steps.push(e.type));
  });
  afterAll(async () => {
    await moduleRef?.close();
  });

  it('above it, takes the lock before the transaction begins and releases it after the commit', async () => {
    steps.length = 0;
    await accounts.lockedOutside('1');
    expect(steps).toEqual(['acquired', 'begin', 'work, hold count 1', 'commit', 'released']);
  });

  it('below it, runs inside the transaction: it begins before the lock is taken and commits after the release', async () => {
    steps.length = 0;
    await accounts.lockedInside('1');
    expect(steps).toEqual(['begin', 'acquired', 'work, hold count 1', 'released', 'commit']);
  });
});
