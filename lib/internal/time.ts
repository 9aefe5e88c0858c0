import { performance } from 'node:perf_hooks';
import * as nodeTimers from 'node:timers';

/** A source of monotonic milliseconds. */
export type Clock = () => number;

/** Monotonic milliseconds for local deadlines; never compared across processes. */
export const now: Clock = () => performance.now();

/**
 * The global `performance.now()`, read at each call: what a test's fake timers replace (Jest's
 * replace the global `performance` along with `setTimeout`, not `node:perf_hooks`). The clock of
 * the memory store, whose leases live in this process (see LockStore.time).
 */
export const globalNow: Clock = () => globalThis.performance.now();

/** A timer of a `Time`: something to cancel, and that need not keep the process alive. */
export interface Timer {
  unref(): unknown;
}

/**
 * A clock and the timers that wait on it, which must agree: a deadline read on one clock and
 * waited for by timers of another is missed (under a test's fake timers, never reached).
 */
export interface Time {
  readonly now: Clock;
  setTimeout(callback: () => void, ms: number): Timer;
  clearTimeout(timer: Timer): void;
  setImmediate(callback: () => void): void;
}

/**
 * Real time: `node:perf_hooks` and `node:timers`, which fake timers leave alone (Jest's replace
 * the globals of the test's context, not Node's modules). Redis's leases run on real time, so
 * every deadline of a Redis lock, and every timer that waits for one, does too.
 */
export const realTime: Time = {
  now,
  setTimeout: (callback, ms) => nodeTimers.setTimeout(callback, ms),
  clearTimeout: (timer) => nodeTimers.clearTimeout(timer as NodeJS.Timeout),
  setImmediate: (callback) => void nodeTimers.setImmediate(callback),
};

/**
 * `process.nextTick` as it was when this module loaded: a test's fake timers installed later (Jest's
 * fake it by default) do not stop what nestjs-locked queues on it (replica confirmation's WAIT).
 */
export const realNextTick: (callback: () => void) => void = process.nextTick;

/**
 * The globals, read at each call (a test may install fake timers after this module loaded): the
 * time of the memory store, whose leases live in this process, so that a test's fake timers move
 * its leases and the timers that wait for them alike.
 */
export const globalTime: Time = {
  now: globalNow,
  setTimeout: (callback, ms) => globalThis.setTimeout(callback, ms),
  clearTimeout: (timer) => globalThis.clearTimeout(timer as NodeJS.Timeout),
  setImmediate: (callback) => void globalThis.setImmediate(callback),
};

/**
 * Settles like `promise`, or rejects with `onTimeout()` after `ms`. The timer never keeps the
 * process alive, and the original promise's late rejection is swallowed (the caller has moved on).
 *
 * An answer already waiting to be read when the timer fires still counts, as after the process was
 * paused past the deadline (a long GC, a starved CPU): Node runs expired timers before it reads the
 * sockets, so the timer only schedules the rejection, for after this turn's reads (setImmediate
 * callbacks run after the poll phase). That immediate is not unref'd: an unref'd one does not stop
 * the poll phase from blocking, and would wait for whatever wakes the process next.
 */
export function withTimeout<T>(promise: Promise<T>, ms: number, onTimeout: () => Error, time: Time = realTime): Promise<T> {
  if (!Number.isFinite(ms)) return promise;
  return new Promise<T>((resolve, reject) => {
    const timer = time.setTimeout(() => {
      time.setImmediate(() => {
        promise.catch(() => undefined);
        reject(onTimeout());
      });
    }, Math.max(0, ms));
    timer.unref();
    promise.then(
      (value) => {
        time.clearTimeout(timer);
        resolve(value);
      },
      (error: unknown) => {
        time.clearTimeout(timer);
        reject(error);
      },
    );
  });
}
