import { anySignal } from './internal/any-signal.js';
import type { LockContext } from './lock-context.js';
import type { LockHandle } from './lock-handle.js';
import { duration, MIN_LEASE_MS } from './lock-options.js';

/**
 * Several locks held together, as `acquire([...keys])` and `run([...keys], fn)` return them: all
 * or nothing, taken in one canonical order (sorted), so two groups over the same keys never
 * deadlock whatever order their callers list them in.
 *
 * @example
 * await locks.run([`account:${from}`, `account:${to}`], async (group) => {
 *   group.signal.throwIfAborted(); // aborts when any of the locks is lost
 *   await transfer(from, to, amount);
 * });
 */
export class LockGroup {
  /**
   * The group's signal, following its handles' signals until it aborts or the group is released.
   * Made on first read of `signal`: most groups are released without anyone reading it.
   */
  private following: { signal: AbortSignal; dispose(): void } | undefined;

  /** @internal */
  constructor(
    /** One handle per key, in canonical (sorted) order. */
    readonly handles: readonly LockHandle[],
    /** @internal */ readonly context: LockContext,
    private readonly runIn: <T>(context: LockContext, fn: () => T) => T,
  ) {}

  /**
   * Aborts as soon as any lock of the group is lost, with that lock's `LockLostError`. Reading it
   * checks every lease deadline on the spot, as a handle's `signal` does.
   */
  get signal(): AbortSignal {
    if (!this.following) this.following = anySignal(this.handles.filter((h) => !h.released).map((h) => h.signal));
    else if (!this.following.signal.aborted) for (const h of this.handles) if (!h.released) void h.signal; // checks the deadline; a loss aborts the group at once
    return this.following.signal;
  }

  /** @internal The group is released: its signal stops following the handles' signals. */
  detach(): void {
    this.following?.dispose();
  }

  /** The keys, in canonical (sorted) order. */
  get keys(): string[] {
    return this.handles.map((h) => h.key);
  }

  get owner(): string {
    return this.context.owner;
  }

  /** The fencing token of each key. */
  get fencingTokens(): Record<string, number> {
    return Object.fromEntries(this.handles.map((h) => [h.key, h.fencingToken]));
  }

  /** True while every lock of the group is held. */
  get isHeld(): boolean {
    return this.handles.every((h) => h.isHeld);
  }

  /** The handle of one key of the group. */
  handle(key: string): LockHandle | undefined {
    return this.handles.find((h) => h.key === key);
  }

  /**
   * Releases every lock of the group: all sent at once (in reverse order), so that a Redis that
   * stops answering holds the group up no longer than one lock. Every release is tried; the first
   * failure (in that order) is thrown once all are settled.
   */
  async release(): Promise<void> {
    this.detach();
    const results = await Promise.allSettled([...this.handles].reverse().map((handle) => handle.release()));
    const failed = results.find((r) => r.status === 'rejected');
    if (failed) throw failed.reason;
  }

  /** Sets the remaining lease of every lock of the group to `leaseMs`. */
  async extend(leaseMs: number): Promise<void> {
    // Checked here too, so that the error names the group's method rather than its handles'.
    duration(leaseMs ?? null, 'leaseMs', 'LockGroup.extend()', { min: MIN_LEASE_MS, fallback: 0 });
    await Promise.all(this.handles.map((h) => h.extend(leaseMs)));
  }

  /** Runs `fn` in the group's owner context: locks taken inside re-enter these. */
  run<T>(fn: () => T): T {
    return this.runIn({ owner: this.context.owner, handle: this.handles[0], group: this, parent: this.context }, fn);
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.release();
  }
}
