import { isObservable, Observable, type Subscription } from 'rxjs';
import { LockNotAcquiredError } from '../errors/lock-not-acquired.error.js';
import type { LockGroup } from '../lock-group.js';
import type { LockHandle } from '../lock-handle.js';
import type { LockedOptions } from '../lock-options.js';
import type { LockService } from '../lock.service.js';

/** What `@Locked` recorded about one method, once, when its class was defined. */
export interface LockedSpec {
  /** `Class.method`, for messages. */
  readonly where: string;
  /** Builds the key (or the keys of a multi-key lock) from the arguments the method receives (after pipes); `self` is the instance (a key function's `this`). */
  readonly keyOf: (args: readonly unknown[], self: unknown) => string | string[];
  readonly options: LockedOptions;
  /** The method declares that it returns an Observable: the lock is taken when it is subscribed. */
  readonly observable: boolean;
  /** The method is an async generator (`async *method()`): the lock is taken when iteration starts. */
  readonly asyncGenerator: boolean;
}

/**
 * The one lock pipeline of decorated methods, used on every call path (controllers, microservice
 * and WebSocket handlers, scheduled jobs, direct calls): build the key from the real arguments,
 * apply the contention policy, run the method inside the lock's context (so nested locked calls
 * re-enter), hold the lock for the whole call (until a Promise settles, an Observable completes,
 * errors or is unsubscribed, or an async generator finishes or is closed), and give it back (after
 * `minHoldMs` at the earliest).
 *
 * `LockInterceptor` adds the transport side for controller handlers (HTTP status, Retry-After,
 * RPC and WebSocket errors); it never takes or releases locks itself.
 */
export function invokeLocked(
  locks: LockService,
  spec: LockedSpec,
  self: unknown,
  args: unknown[],
  method: (...args: unknown[]) => unknown,
): unknown {
  const key = () => spec.keyOf(args, self);
  if (spec.observable) return lockedObservable(locks, spec, () => method.apply(self, args), key);
  if (spec.asyncGenerator) return lockedAsyncGenerator(locks, spec, () => method.apply(self, args) as AsyncGenerator<unknown, unknown, unknown>, key);
  return lockedPromise(locks, spec, () => method.apply(self, args), key);
}

async function lockedPromise(locks: LockService, spec: LockedSpec, call: () => unknown, key: () => string | string[]): Promise<unknown> {
  const handle = await enter(locks, spec, key);
  if (!handle) return undefined;
  let result: unknown;
  try {
    result = handle.run(call);
  } catch (error) {
    await leave(locks, spec, handle);
    throw error;
  }
  // An Observable from a method that did not declare it: hold the lock until it finishes.
  if (isObservable(result)) {
    locks.noteUndeclaredObservable(spec);
    return holdWhileSubscribed(result, () => leave(locks, spec, handle));
  }
  try {
    return await result;
  } finally {
    await leave(locks, spec, handle);
  }
}

/**
 * Takes the lock when subscribed; releases it on complete, error or unsubscribe (a client that
 * goes away). A subscriber that leaves while the lock is still awaited ends that wait at once.
 */
function lockedObservable(locks: LockService, spec: LockedSpec, call: () => unknown, key: () => string | string[]): Observable<unknown> {
  return new Observable<unknown>((subscriber) => {
    let inner: Subscription | undefined;
    let finished = false;
    let handle: Held | undefined;
    const unsubscribed = new AbortController();
    const finish = () => {
      if (finished) return;
      finished = true;
      unsubscribed.abort();
      inner?.unsubscribe();
      if (handle) void leave(locks, spec, handle);
    };
    enter(locks, spec, key, unsubscribed.signal).then(
      (taken) => {
        if (!taken) return subscriber.complete(); // skipped: nothing to emit
        handle = taken;
        if (finished) return void leave(locks, spec, taken); // unsubscribed while waiting
        let source: unknown;
        try {
          source = taken.run(call);
        } catch (error) {
          return subscriber.error(error);
        }
        const stream = isObservable(source) ? source : new Observable((s) => void Promise.resolve(source).then((v) => (s.next(v), s.complete()), (e: unknown) => s.error(e)));
        inner = taken.run(() => stream.subscribe(subscriber));
      },
      (error: unknown) => subscriber.error(error),
    );
    return finish;
  });
}

/**
 * Takes the lock when iteration starts (the first `next()`), and runs every step of the method's
 * generator inside the lock's context; releases it when the generator returns or throws, or when the
 * caller closes it (`break` out of `for await` calls `return()`, which runs the method's `finally`
 * blocks first, still under the lock).
 */
async function* lockedAsyncGenerator(
  locks: LockService,
  spec: LockedSpec,
  call: () => AsyncGenerator<unknown, unknown, unknown>,
  key: () => string | string[],
): AsyncGenerator<unknown, unknown, unknown> {
  const handle = await enter(locks, spec, key);
  if (!handle) return undefined; // skipped: nothing to yield
  try {
    const inner = handle.run(call);
    const underLock: AsyncIterable<unknown, unknown, unknown> = {
      [Symbol.asyncIterator]: () => ({
        next: (...value: [] | [unknown]) => handle.run(() => inner.next(...value)),
        return: (value: unknown) => handle.run(() => inner.return(value)),
        throw: (error: unknown) => handle.run(() => inner.throw(error)),
      }),
    };
    return yield* underLock;
  } finally {
    await leave(locks, spec, handle);
  }
}

function holdWhileSubscribed(source: Observable<unknown>, release: () => Promise<void>): Observable<unknown> {
  let released = false;
  const once = () => {
    if (!released) {
      released = true;
      void release();
    }
  };
  return new Observable((subscriber) => {
    const inner = source.subscribe(subscriber);
    return () => {
      inner.unsubscribe();
      once();
    };
  });
}

/** One lock, or the group of a multi-key lock. */
type Held = LockHandle | LockGroup;

/** Takes the lock of `keyOf()` per the contention policy; `undefined` when the call is skipped. `signal` ends a wait. */
async function enter(locks: LockService, spec: LockedSpec, keyOf: () => string | string[], signal?: AbortSignal): Promise<Held | undefined> {
  const key = keyOf();
  const plan = locks.lockedPlan(spec);
  const acquire = signal ? { ...plan.acquire, signal } : plan.acquire;
  const taken = locks.acquireResolved(key, acquire, spec.where);
  const held = plan.minHoldMs > 0 ? taken.then((h) => locks.holdAtLeast(h, plan.minHoldMs)) : taken;
  if (plan.policy !== 'skip') return held;
  try {
    return await held;
  } catch (error) {
    if (!(error instanceof LockNotAcquiredError)) throw error;
    locks.noteSkipped(error.key, spec.where);
    return undefined;
  }
}

/** Gives one hold back, keeping the lock until `minHoldMs` after it was taken; never throws. */
async function leave(locks: LockService, spec: LockedSpec, handle: Held): Promise<void> {
  const { minHoldMs } = locks.lockedPlan(spec);
  await locks.releaseQuietly(handle, minHoldMs);
}
