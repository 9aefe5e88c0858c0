import { performance } from 'node:perf_hooks';

/** A source of monotonic milliseconds. */
export type Clock = () => number;

/** Monotonic milliseconds for local deadlines; never compared across processes. */
export const now: Clock = () => performance.now();

/**
 * The global `performance.now()`, read at each call: what a test's fake timers replace (Jest's
 * replace the global `performance` along with `setTimeout`, not `node:perf_hooks`). The clock of
 * the memory store, whose leases live in this process (see LockStore.clock).
 */
export const globalNow: Clock = () => globalThis.performance.now();

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
export function withTimeout<T>(promise: Promise<T>, ms: number, onTimeout: () => Error): Promise<T> {
  if (!Number.isFinite(ms)) return promise;
  return new Promise<T>((resolve, reject) => {
    const timer = setTimeout(() => {
      setImmediate(() => {
        promise.catch(() => undefined);
        reject(onTimeout());
      });
    }, Math.max(0, ms));
    timer.unref();
    promise.then(
      (value) => {
        clearTimeout(timer);
        resolve(value);
      },
      (error: unknown) => {
        clearTimeout(timer);
        reject(error);
      },
    );
  });
}
