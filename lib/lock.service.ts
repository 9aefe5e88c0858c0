import { AsyncLocalStorage } from 'node:async_hooks';
import { randomBytes } from 'node:crypto';
import { setMaxListeners } from 'node:events';
import { Inject, Injectable, Logger, Optional, type OnApplicationBootstrap, type OnApplicationShutdown, type OnModuleInit } from '@nestjs/common';
import { ModuleRef } from '@nestjs/core';
import { Subject, type Observable } from 'rxjs';
import { LockBackendError } from './errors/lock-backend.error.js';
import { LockConfigurationError } from './errors/lock-configuration.error.js';
import { LockError } from './errors/lock.error.js';
import { LockLostError, type LockLossReason } from './errors/lock-lost.error.js';
import { LockNotAcquiredError } from './errors/lock-not-acquired.error.js';
import { LockUpgradeError } from './errors/lock-upgrade.error.js';
import { HeldLock, heldLockId } from './held-lock.js';
import { realTime, withTimeout, type Time, type Timer } from './internal/time.js';
import { OutageLog } from './internal/outage-log.js';
import { anySignal } from './internal/any-signal.js';
import { LOCK_MODULE_OPTIONS } from './lock.constants.js';
import type { LockContext } from './lock-context.js';
import type { LockEvent } from './lock-events.js';
import { LockGroup } from './lock-group.js';
import { LockHandle } from './lock-handle.js';
import { assertLockKey, canonicalKeys } from './lock-key.js';
import {
  describe,
  duration,
  exclusiveGroup,
  MIN_LEASE_MS,
  resolveHoldCountOptions,
  resolveLockOptions,
  resolveModuleOptions,
  sided,
  type ContentionPolicy,
  type LockModuleOptions,
  type LockOptions,
  type ResolvedLockOptions,
  type ResolvedModuleOptions,
} from './lock-options.js';
import { Watchdog } from './renewal/watchdog.js';
import type { LockedSpec } from './decorators/lock-pipeline.js';
import type { AcquireResult, Handover, HoldsHere, LockMode, LockStore, ReleaseWatch, TakeAlong } from './store/lock-store.js';
import { createStore } from './store/create-store.js';

/** What to do about `LockModule.forRoot()` imported more than once (the bootstrap warning and the refusal of refuseOwnLock). */
const IMPORT_ONCE = 'Import LockModule.forRoot() once, with isGlobal: true (or in one module that exports LockModule), so that every module injects the same LockService.';

/** How long shutdown waits for Redis to take back the locks still held, and for acquisitions in progress to end. */
const SHUTDOWN_RELEASE_MS = 2_000;

/**
 * Reentrant, renewing Redis locks. Inject it anywhere `LockModule` is imported.
 *
 * Owner model: a lock belongs to an owner = this service's id + a logical execution context. A
 * context starts when code takes a lock with `run()` (or a `@Locked` method, or `handle.run()`);
 * every acquisition of the same key inside it, however deep in awaits, re-enters. Two requests or
 * jobs are two contexts and contend. `acquire()` outside any context starts a new owner each time.
 *
 * @example
 * await locks.run(`account:${id}`, async (lock) => {
 *   const balance = await repo.balance(id);
 *   lock.signal.throwIfAborted();
 *   await repo.setBalance(id, balance - amount);
 * });
 */
@Injectable()
export class LockService implements OnModuleInit, OnApplicationBootstrap, OnApplicationShutdown {
  private readonly logger = new Logger('LockService');
  private readonly options: ResolvedModuleOptions;
  private readonly store: LockStore;
  /** The clock of every local deadline of this service's locks, and the timers that wait for them (see LockStore.time). */
  private readonly time: Time;
  private readonly watchdog: Watchdog;
  private readonly contexts = new AsyncLocalStorage<LockContext>();
  private readonly held = new Map<string, HeldLock>();
  /** Every owner this service makes for a context starts with this random id (see contextFor, countHolds). */
  private readonly ownerPrefix = `${randomBytes(9).toString('base64url')}:`;
  private contextCount = 0;
  private readonly plans = new WeakMap<LockedSpec, LockedPlan>();
  /** `@Locked` methods already warned about returning an Observable they do not declare (once each). */
  private readonly undeclaredObservables = new WeakSet<LockedSpec>();
  private readonly events = new Subject<LockEvent>();
  private closing: Promise<void> | undefined;
  /**
   * Aborted at shutdown: wakes every waiting acquisition, which then fails (see shutDown()). Each
   * sleeping waiter listens to it, so it takes any number of listeners without Node's
   * "possible EventTarget memory leak" warning (each listener goes when its sleep ends).
   */
  private readonly shutdown = unlimitedListeners(new AbortController());
  /** A Redis outage fails every `@Locked` call: their causes are logged at most once per interval (see OutageLog). */
  private readonly unavailableLog = new OutageLog(this.logger, '@Locked calls were answered "unavailable"', 'locks can be had again');
  /** Likewise the releases of `run()` and `@Locked` that failed (their leases free those locks). */
  private readonly releaseFailureLog = new OutageLog(this.logger, 'releases failed', 'releases work again');
  /** Acquisitions in progress (an attempt in flight, or waiting), and who to tell when the last one has ended (shutdown waits for them). */
  private acquiring = 0;
  /**
   * Acquisition attempts given up on (see `bounded`) whose reply has not come yet, by held-lock id:
   * each settles once the reply came and a late grant was given back. The next attempt of that
   * owner on that lock (and side) is sent only then: sent earlier, Redis would count it on top of
   * that grant, and a fresh acquisition would read as a re-entry (hold count 2, `reentered`).
   */
  private readonly givenUp = new Map<string, Promise<void>>();
  /**
   * Acquisitions in progress by held-lock id (owner, key, side), for `markLost`: a lock lost while
   * its owner is acquiring it again must not be taken back (see there).
   */
  private readonly acquiringIds = new Map<string, number>();
  private lastAcquisitionEnded: (() => void) | undefined;
  /**
   * Write (or exclusive) holds kept for `minHoldMs` whose owner may read the lock meanwhile (see
   * keepHold): a timer gives each back when `minHoldMs` is up.
   */
  private readonly kept = new Set<KeptHold>();

  /**
   * Everything that happens to locks of this service: acquired, reentered, released, contended,
   * timed-out, renewed, renew-failed, lost, release-failed. Completes at shutdown.
   */
  readonly events$: Observable<LockEvent> = this.events.asObservable();

  constructor(
    @Inject(LOCK_MODULE_OPTIONS) options: LockModuleOptions,
    /**
     * Finds the other LockServices of this application: more than one when `LockModule.forRoot()`
     * is imported more than once (see refuseOwnLock). Absent when the service is created without Nest.
     */
    @Optional() private readonly moduleRef?: ModuleRef,
  ) {
    this.options = resolveModuleOptions(options);
    this.store = createStore(this.options, this.logger);
    this.time = this.store.time ?? realTime;
    this.watchdog = new Watchdog({
      renew: (locks) => this.store.renew(locks.map((l) => ({ key: l.key, owner: l.owner, leaseMs: l.leaseMs, mode: l.mode }))),
      group: (lock) => this.store.renewalGroup?.(lock.key) ?? 0,
      renewed: (locks) => {
        if (!this.events.observed) return;
        for (const l of locks) this.emit({ type: 'renewed', key: l.key, owner: l.owner, leaseMs: l.leaseMs });
      },
      lost: (lock, reason) => void this.markLost(lock, reason),
      renewFailed: (locks, error) => {
        this.logger.debug(`renewal of ${locks.length} lock(s) failed, retrying until their leases end: ${String(error)}`);
        if (!this.events.observed) return;
        for (const l of locks) this.emit({ type: 'renew-failed', key: l.key, owner: l.owner, error });
      },
      renewUnanswered: (locks, afterMs) => {
        const error = new LockBackendError('renewal', locks.length === 1 ? locks[0].key : undefined, new AttemptTimeout(afterMs));
        this.logger.debug(`renewal of ${locks.length} lock(s) has had no answer for ${afterMs} ms, still waiting for it until their leases end`);
        if (!this.events.observed) return;
        for (const l of locks) this.emit({ type: 'renew-failed', key: l.key, owner: l.owner, error });
      },
    }, this.time, this.store.boundsSteps ? undefined : this.stepLimitMs());
  }

  /** Nest lifecycle hook: waits for Redis at bootstrap (see `connectTimeoutMs`). Call it yourself only when you create the service without Nest. */
  async onModuleInit(): Promise<void> {
    const timeoutMs = this.options.connectTimeoutMs;
    if (timeoutMs === 0) {
      // No check, but the connections start now rather than at the first lock.
      this.store.connect?.();
      return;
    }
    try {
      await this.store.ready(timeoutMs);
    } catch (error) {
      await this.store.close();
      // What Redis is, rather than whether it answers (a version too old): said as it is.
      if (error instanceof LockConfigurationError) throw error;
      throw new LockBackendError(
        'bootstrap',
        undefined,
        new Error(`${error instanceof Error ? error.message : String(error)} (check the redis option, or set connectTimeoutMs: 0 to start without checking)`),
      );
    }
  }

  /**
   * Nest lifecycle hook: once every module is initialised, says (once per application, from its
   * first LockService) when `LockModule.forRoot()` was imported more than once.
   */
  onApplicationBootstrap(): void {
    const all = this.all();
    if (all.length < 2 || all[0] !== this) return;
    this.logger.warn(
      `LockModule.forRoot() is imported ${all.length} times in this application: each import makes a LockService of its own, ` +
        `with its own connections (on the memory store, its own locks, which never exclude another import's), and a lock is reentrant only through the LockService that took it ` +
        `(a nested acquisition of a key its caller holds through another import fails with a LockConfigurationError). ` +
        IMPORT_ONCE,
    );
  }

  /** Nest lifecycle hook: stops renewal, releases every held lock, closes the connections this module opened. */
  async onApplicationShutdown(): Promise<void> {
    await this.close();
  }

  /**
   * Acquires `key`, waiting up to `waitMs` while another owner holds it. Inside a context that
   * holds `key` already, re-enters (hold count + 1).
   *
   * @throws LockNotAcquiredError when the lock stayed held for the whole wait.
   * @throws the `signal`'s reason when `options.signal` aborts the wait.
   * @example
   * const lock = await locks.acquire('report:daily', { waitMs: 0 });
   */
  async acquire(key: string, options?: LockOptions): Promise<LockHandle>;
  /**
   * Several keys, all or nothing, taken in one canonical (sorted) order: two callers listing the
   * same keys in opposite orders never deadlock. On one Redis server the whole group is taken in
   * one atomic script. Exclusive locks only (no `mode`, no `fair`).
   *
   * @example
   * const group = await locks.acquire([`account:${from}`, `account:${to}`]);
   */
  async acquire(keys: readonly string[], options?: LockOptions): Promise<LockGroup>;
  acquire(key: string | readonly string[], options?: LockOptions): Promise<LockHandle | LockGroup> {
    return this.acquireAs(key, options, 'LockService.acquire()');
  }

  /** `acquire()`, as `where` names it; `mode`: readLock() or writeLock(), whose side the options must not contradict. */
  private acquireAs(key: unknown, options: unknown, where: string, mode?: 'read' | 'write'): Promise<LockHandle | LockGroup> {
    // Not an async function: the promise of take() is returned as it is, without another layer
    // (this runs on every acquisition); bad input still rejects rather than throws.
    try {
      const o = resolveLockOptions((mode ? sided(options, mode, where) : options) as LockOptions | undefined, this.options, where);
      if (typeof key !== 'string' && Array.isArray(key)) return this.takeGroup(canonicalKeys(key, where), o, this.contextFor(o), where);
      assertLockKey(key, where);
      return this.take(key as string, o, this.contextFor(o));
    } catch (error) {
      return Promise.reject(error);
    }
  }

  /**
   * One attempt, no waiting: the handle, or `null` when another owner holds the lock.
   *
   * @example
   * const lock = await locks.tryAcquire('cache:rebuild');
   * if (!lock) return; // someone else is rebuilding
   */
  async tryAcquire(key: string, options?: Omit<LockOptions, 'waitMs'>): Promise<LockHandle | null>;
  /** Several keys in one attempt, all or nothing: the group, or `null`. */
  async tryAcquire(keys: readonly string[], options?: Omit<LockOptions, 'waitMs'>): Promise<LockGroup | null>;
  async tryAcquire(key: string | readonly string[], options?: Omit<LockOptions, 'waitMs'>): Promise<LockHandle | LockGroup | null> {
    const where = 'LockService.tryAcquire()';
    const o = resolveLockOptions(options, this.options, where);
    if ((options as LockOptions | undefined)?.waitMs !== undefined) {
      throw new LockConfigurationError('waitMs', 'LockService.tryAcquire() never waits; use acquire() to pass waitMs.');
    }
    const keys = typeof key !== 'string' && Array.isArray(key) ? canonicalKeys(key, where) : undefined;
    if (!keys) assertLockKey(key, where);
    try {
      if (keys) return await this.takeGroup(keys, { ...o, waitMs: 0 }, this.contextFor(o), where);
      return await this.take(key as string, { ...o, waitMs: 0 }, this.contextFor(o));
    } catch (error) {
      if (error instanceof LockNotAcquiredError) return null;
      throw error;
    }
  }

  /**
   * Acquires `key`, runs `fn` inside the lock's context (nested acquisitions re-enter), and
   * releases whatever happens. Returns `fn`'s value or rethrows `fn`'s error unchanged; a failed
   * release never replaces either (it is logged and emitted as `release-failed`).
   *
   * @example
   * const total = await locks.run(`cart:${cartId}`, async () => checkout(cartId));
   */
  async run<T>(key: string, fn: (lock: LockHandle) => T | Promise<T>, options?: LockOptions): Promise<Awaited<T>>;
  /** Several keys (see `acquire(keys)`), held together while `fn` runs. */
  async run<T>(keys: readonly string[], fn: (group: LockGroup) => T | Promise<T>, options?: LockOptions): Promise<Awaited<T>>;
  async run<T>(key: string | readonly string[], fn: (lock: never) => T | Promise<T>, options?: LockOptions): Promise<Awaited<T>> {
    const where = 'LockService.run()';
    const keys = typeof key !== 'string' && Array.isArray(key) ? canonicalKeys(key, where) : undefined;
    if (!keys) assertLockKey(key, where);
    if (typeof fn !== 'function') {
      throw new LockConfigurationError('fn', 'LockService.run(key, fn): fn must be a function that does the protected work.');
    }
    const o = resolveLockOptions(options, this.options, where);
    const context = this.contextFor(o);
    const held = keys ? await this.takeGroup(keys, o, context, where) : await this.take(key as string, o, context);
    try {
      return await held.run(() => fn(held as never));
    } finally {
      await this.releaseQuietly(held);
    }
  }

  /**
   * The innermost lock held by the current context (`run()`, a `@Locked` method, `handle.run()`),
   * or the innermost one on `key`; `undefined` outside any. A `key` that is no lock key (a number,
   * an array of keys) throws `LockKeyError` rather than answering `undefined` for ever.
   */
  current(key?: string): LockHandle | undefined {
    if (key !== undefined) assertLockKey(key, 'LockService.current()');
    return innermostHeld(this.contexts.getStore(), key);
  }

  /** Whether any owner holds `key` now. */
  async isLocked(key: string): Promise<boolean> {
    assertLockKey(key, 'LockService.isLocked()');
    return (await this.inspect(key, undefined, 'isLocked')).locked;
  }

  /** How many holds the current context (or `options.owner`) has on `key` (on its `mode` side); 0 when none. */
  async holdCount(key: string, options?: Pick<LockOptions, 'owner' | 'mode'>): Promise<number> {
    assertLockKey(key, 'LockService.holdCount()');
    const o = resolveHoldCountOptions(options, 'LockService.holdCount()');
    const owner = o.owner ?? this.liveContext()?.owner;
    if (owner === undefined) return 0;
    return (await this.inspect(key, owner, 'holdCount', o.mode)).holdCount;
  }

  /**
   * The read side of the read-write lock `key`: many readers at once, no writer meanwhile.
   * Same as `acquire(key, { ...options, mode: 'read' })`; a `mode` of another side in `options` is refused.
   *
   * @example
   * const lock = await locks.readLock(`doc:${id}`);
   */
  readLock(key: string, options?: Omit<LockOptions, 'mode'>): Promise<LockHandle> {
    return this.acquireAs(key, options, 'LockService.readLock()', 'read') as Promise<LockHandle>;
  }

  /**
   * The write side of the read-write lock `key`: one writer, no reader meanwhile; a writer may also
   * take the read side (downgrade). Same as `acquire(key, { ...options, mode: 'write' })`; a `mode`
   * of another side in `options` is refused.
   */
  writeLock(key: string, options?: Omit<LockOptions, 'mode'>): Promise<LockHandle> {
    return this.acquireAs(key, options, 'LockService.writeLock()', 'write') as Promise<LockHandle>;
  }

  /** The remaining lease of `key` in ms, `null` when it is not locked, `Infinity` when it has no expiry (not set by us). */
  async remainingTtl(key: string): Promise<number | null> {
    assertLockKey(key, 'LockService.remainingTtl()');
    const state = await this.inspect(key, undefined, 'remainingTtl');
    if (!state.locked) return null;
    return state.ttlMs === -1 ? Infinity : state.ttlMs;
  }

  /**
   * Deletes `key` whoever holds it, and wakes its waiters. For operators clearing a lock left by a
   * process that cannot release it. Holders in this process see their signal abort at once; holders
   * elsewhere at their next renewal. Returns whether there was a lock. Missing keys are a no-op.
   */
  async forceUnlock(key: string): Promise<boolean> {
    assertLockKey(key, 'LockService.forceUnlock()');
    let existed: boolean;
    const request = this.store.forceUnlock(key);
    try {
      existed = await this.step(request);
    } catch (error) {
      // Given up on, but sent: Redis runs it if it comes back, and this process's holders of the key
      // are told when its reply comes, as when it is answered in time, rather than at their next
      // renewal. An acquisition sent after its delete script, on the same connection, runs after it
      // and is answered after it, so it is not among them.
      if (error instanceof AttemptTimeout) request.then(() => this.forceUnlocked(key), () => undefined);
      throw new LockBackendError('forceUnlock', key, error);
    }
    this.forceUnlocked(key);
    return existed;
  }

  /** A force-unlock of `key` ran in Redis: every hold of it in this process is gone. */
  private forceUnlocked(key: string): void {
    for (const lock of [...this.held.values()]) if (lock.key === key) void this.markLost(lock, 'taken');
  }

  /**
   * A health snapshot for readiness probes: whether the store answers within `timeoutMs` and has
   * its scripts loaded (they are loaded again if Redis forgot them), how many locks this service
   * holds, and how late its most overdue renewal is (renewal is keeping up while that stays well
   * below a third of the lease). Never throws for the store's sake: only a `timeoutMs` that is not a
   * whole number of ms from 0 to `MAX_DURATION_MS` (or `Infinity`) is refused, with a
   * `LockConfigurationError`. See the README for a `@nestjs/terminus` indicator.
   */
  async health(timeoutMs = 1_000): Promise<LockHealth> {
    // A string from the environment, NaN or more than a timer holds would wait for ever or not at all.
    const ms = duration(timeoutMs, 'timeoutMs', 'LockService.health()', { min: 0, fallback: 1_000, infinity: true });
    const base = { store: this.store.description, heldLocks: this.held.size, renewalOverdueMs: Math.round(this.watchdog.overdueMs()) };
    if (this.closing) return { status: 'down', ...base, error: 'the lock module has shut down' };
    try {
      await this.store.ready(ms);
      return { status: 'up', ...base };
    } catch (error) {
      return { status: 'down', ...base, error: error instanceof Error ? error.message : String(error) };
    }
  }

  // ---- internals ------------------------------------------------------------------------------

  /** @internal The module's options, resolved. */
  get settings(): ResolvedModuleOptions {
    return this.options;
  }

  /** Clock drift taken off local lease deadlines (Redlock; 0 elsewhere). */
  private readonly drift = (leaseMs: number): number => this.store.driftMs?.(leaseMs) ?? 0;

  /** @internal How a `@Locked` method takes its lock under this module's defaults (computed once per method). */
  lockedPlan(spec: LockedSpec): LockedPlan {
    let plan = this.plans.get(spec);
    if (!plan) {
      const { onContention, minHoldMs, ...lockOptions } = spec.options;
      const policy = onContention ?? this.options.onContention;
      const acquire = resolveLockOptions(lockOptions, this.options, spec.where);
      plan = {
        policy,
        // A read lock is shared, with one lease in Redis for all its readers: a read hold kept
        // after the call would last as long as the others keep the lock (validateLockedOptions).
        minHoldMs: acquire.mode === 'read' ? 0 : (minHoldMs ?? this.options.minHoldMs),
        acquire: policy === 'wait' ? acquire : { ...acquire, waitMs: 0 },
      };
      this.plans.set(spec, plan);
    }
    return plan;
  }

  /** @internal acquire() with options already resolved; an array takes a group. */
  acquireResolved(key: string | readonly string[], o: ResolvedLockOptions, where = 'LockService'): Promise<LockHandle | LockGroup> {
    if (typeof key === 'string') return this.take(key, o, this.contextFor(o));
    return this.takeGroup(canonicalKeys(key, where), o, this.contextFor(o), where);
  }

  /**
   * Takes every key of a group, all or nothing. With a store that can, in one atomic step per
   * attempt; while another owner holds one of the keys, sleeps on that key's release channel.
   * Otherwise one key at a time in canonical order, giving back what it took if one fails.
   */
  private async takeGroup(keys: readonly string[], o: ResolvedLockOptions, context: LockContext, where: string): Promise<LockGroup> {
    exclusiveGroup(o.fair, o.mode, where);
    if (this.closing) throw shutDown(keys.join(', '));
    const acquireMany = (this.store.groupsAtomically?.(keys) ?? true) ? this.store.acquireMany?.bind(this.store) : undefined;
    if (!acquireMany) return this.takeOneByOne(keys, o, context);
    o.signal?.throwIfAborted();
    const started = this.time.now();
    const deadline = started + o.waitMs;
    let watch: { key: string; on: ReleaseWatch } | undefined;
    let contended = false;
    let sleep: ReturnType<LockService['sleepSignal']> | undefined;
    this.acquiring++;
    const ids = keys.map((key) => heldLockId(context.owner, key, 'exclusive'));
    this.acquisitionStarted(ids);
    try {
      for (;;) {
        o.signal?.throwIfAborted();
        if (this.closing) throw shutDown(keys.join(', '));
        const start = this.time.now();
        const result = await this.bounded(() => acquireMany(keys, context.owner, o.leaseMs, this.countHolds), context.owner, keys, 'exclusive', start, deadline, (late) =>
          late.granted ? Promise.all(keys.map((key) => this.giveBackHold(key, context.owner, 'exclusive'))) : undefined,
        );
        if (result.granted && this.leaseRanOut(start, o) && (await this.givenBack(o, context.owner, keys.map((key, i) => ({ key, holdCount: result.grants[i]!.holdCount }))))) continue;
        if (result.granted) {
          const grants = result.grants;
          if (this.closing) {
            // Shutdown began while this attempt was in flight: give the grant back, fail like any acquisition now.
            await this.givenBack(o, context.owner, keys.map((key, i) => ({ key, holdCount: grants[i]!.holdCount })));
            throw shutDown(keys.join(', '));
          }
          const handles = keys.map((key, i) => this.granted(key, context, o, { granted: true, ...grants[i]! }, start, started));
          return new LockGroup(handles, context, (c, fn) => this.runInContext(c, fn));
        }
        const retryAfterMs = result.ttlMs < 0 ? undefined : result.ttlMs;
        if (!contended) {
          contended = true;
          if (o.waitMs > 0) await this.refuseOwnLock(result.blockedBy, context.owner, o);
          this.emit({ type: 'contended', key: result.blockedBy, owner: context.owner, retryAfterMs });
        }
        if (o.waitMs === 0) throw new LockNotAcquiredError(result.blockedBy, retryAfterMs, this.time.now() - started, 'contended');
        if (watch?.key !== result.blockedBy) {
          // Watch the key that blocks us, then try again before sleeping (no release can slip by).
          watch?.on.close();
          watch = { key: result.blockedBy, on: this.store.watch(result.blockedBy, context.owner) };
          await withTimeout(watch.on.ready, deadline - this.time.now(), () => new Error('subscribe timed out'), this.time).catch(() => undefined);
          continue;
        }
        const remaining = deadline - this.time.now();
        if (remaining <= 0) {
          this.emit({ type: 'timed-out', key: result.blockedBy, owner: context.owner, waitedMs: this.time.now() - started });
          throw new LockNotAcquiredError(result.blockedBy, retryAfterMs, this.time.now() - started, 'timeout');
        }
        sleep ??= this.sleepSignal(o);
        const how = await watch.on.sleep(Math.min(result.ttlMs >= 0 ? result.ttlMs + 1 : 1_000, remaining), sleep.signal);
        if (how === 'aborted') o.signal?.throwIfAborted();
      }
    } finally {
      sleep?.dispose();
      watch?.on.close();
      this.acquisitionEnded(ids);
    }
  }

  /** The group path for stores without an atomic multi-key step: canonical order, rollback on failure. */
  private async takeOneByOne(keys: readonly string[], o: ResolvedLockOptions, context: LockContext): Promise<LockGroup> {
    const deadline = this.time.now() + o.waitMs;
    const handles: LockHandle[] = [];
    try {
      for (const key of keys) handles.push(await this.take(key, { ...o, waitMs: Math.max(0, deadline - this.time.now()) }, context));
    } catch (error) {
      // All at once, as a group's release: a Redis that stopped answering costs one bound, not one per key.
      await Promise.all(handles.reverse().map((handle) => this.releaseQuietly(handle)));
      throw error;
    }
    return new LockGroup(handles, context, (c, fn) => this.runInContext(c, fn));
  }

  /**
   * @internal A `@Locked` method returned an Observable without declaring it: its lock was taken at
   * the call, not on subscription. Warned once per method.
   */
  noteUndeclaredObservable(spec: LockedSpec): void {
    if (this.undeclaredObservables.has(spec)) return;
    this.undeclaredObservables.add(spec);
    this.logger.warn(
      `${spec.where} returned an Observable without declaring it: its lock was taken at the call and is held until that Observable is subscribed and ends (one never subscribed keeps the lock until shutdown). Declare its return type as Observable<...> (read through emitDecoratorMetadata; a subclass such as Subject is not recognised) so the lock is taken on subscription.`,
    );
  }

  /**
   * @internal A `@Locked` handler's lock could not be had for want of Redis, and its transport
   * answers "unavailable" (HTTP 503), which Nest's exception filters do not log: this logs the cause.
   */
  noteUnavailable(error: Error): void {
    this.unavailableLog.failed(error.message);
  }

  /** @internal A skipped `@Locked` call. */
  noteSkipped(key: string, method: string): void {
    const owner = this.liveContext()?.owner ?? '';
    this.logger.debug(`${method} skipped: "${key}" is held by another owner`);
    this.emit({ type: 'skipped', key, owner, method });
  }

  private contextFor(o: ResolvedLockOptions): LockContext {
    if (o.owner !== undefined) return { owner: o.owner };
    return this.liveContext() ?? { owner: `${this.ownerPrefix}${++this.contextCount}` };
  }

  /**
   * The calling context while it still belongs to a held lock: one of its handles, or an outer
   * context's, not yet released. Work that outlives its lock keeps the context it started in (a
   * timer, a socket, a consumer's callbacks created inside the lock run in it after the release);
   * two such callbacks would otherwise share one owner and re-enter each other's locks, so each
   * acquisition they make starts an owner of its own, as outside any lock.
   */
  private liveContext(): LockContext | undefined {
    return this.current() === undefined ? undefined : this.contexts.getStore();
  }

  /** @internal */
  get noFencingTokens(): string | undefined {
    if (this.options.redlock) return 'with redlock, counters on independent masters cannot be made monotonic together. Use one Redis server, Sentinel or Cluster where fencing matters.';
    if (!this.options.fencingTokens) return 'fencingTokens is false in the LockModule options. Set it to true (the default) to get tokens.';
    return undefined;
  }

  /** @internal */
  runInContext<T>(context: LockContext, fn: () => T): T {
    if (typeof fn !== 'function') {
      throw new LockConfigurationError('fn', `${context.group ? 'LockGroup' : 'LockHandle'}.run(fn): fn must be a function to run in the lock's context; got ${describe(fn)}.`);
    }
    return this.contexts.run(context, fn);
  }

  private async take(key: string, o: ResolvedLockOptions, context: LockContext): Promise<LockHandle> {
    if (this.closing) throw shutDown(key);
    if (o.fair && this.store.supportsFairMode === false) {
      throw new LockConfigurationError('fair', `fair mode keeps its queue on one Redis; it is not available with ${this.store.description}. Leave fair out.`);
    }
    o.signal?.throwIfAborted();
    this.acquiring++;
    const ids = [heldLockId(context.owner, key, o.mode)];
    this.acquisitionStarted(ids);
    try {
      const started = this.time.now();
      const deadline = started + o.waitMs;
      let attempt: Awaited<ReturnType<LockService['attempt']>>;
      try {
        attempt = await this.attempt(key, context.owner, o, deadline, undefined, started);
      } catch (error) {
        // Redis did not answer in time, or too few Redlock nodes did: the attempt may still have
        // queued this owner where it was refused (a fair waiter's place; a waiting writer, which
        // keeps new readers out until its place lapses). Leave it, as a wait that ends does.
        await this.abandon(key, context.owner, o);
        throw error;
      }
      if (attempt.result.granted) return this.granted(key, context, o, attempt.result, attempt.start, started);
      if (attempt.result.upgrade) throw new LockUpgradeError(key);
      if (o.waitMs > 0) await this.refuseOwnLock(key, context.owner, o);
      const retryAfter = (r: AcquireResult) => (r.granted || r.ttlMs < 0 ? undefined : r.ttlMs);
      this.emit({ type: 'contended', key, owner: context.owner, retryAfterMs: retryAfter(attempt.result) });
      if (o.waitMs === 0) {
        await this.abandon(key, context.owner, o);
        throw new LockNotAcquiredError(key, retryAfter(attempt.result), this.time.now() - started, 'contended');
      }
      this.logger.debug(`"${key}" is held by another owner; waiting up to ${o.waitMs} ms`);
      // An exclusive default-mode wait may be handed the lock by a release of this process (see takeHandover).
      const watch = this.store.watch(key, context.owner, o.mode === 'exclusive' && !o.fair ? o.leaseMs : undefined);
      const sleep = this.sleepSignal(o);
      let woken = false;
      let granted = false;
      try {
        await withTimeout(watch.ready, deadline - this.time.now(), () => new Error('subscribe timed out'), this.time).catch(() => undefined);
        for (;;) {
          o.signal?.throwIfAborted();
          if (this.closing) throw shutDown(key);
          attempt = await this.attempt(key, context.owner, o, deadline, watch.waitId);
          if (attempt.result.granted) {
            // A reader that a release woke passes the wake on as it leaves (watch.close): readers
            // share, so the next waiter of this process may get in too. A plain lock's release
            // wakes one waiter per process; the readers waiting on it then follow one by one.
            woken = woken && o.mode === 'read';
            granted = true;
            return this.granted(key, context, o, attempt.result, attempt.start, started);
          }
          watch.forgetGrant(attempt.result.lastToken);
          woken = false;
          const remaining = deadline - this.time.now();
          if (remaining <= 0) {
            this.emit({ type: 'timed-out', key, owner: context.owner, waitedMs: this.time.now() - started });
            throw new LockNotAcquiredError(key, retryAfter(attempt.result), this.time.now() - started, 'timeout');
          }
          // Sleep until a release wakes us; the holder's lease bounds the sleep, so a lost release
          // message costs at most that lease. A key without expiry (not ours) is re-checked every second.
          // A fair waiter, or a waiting writer, comes back before its place runs out.
          // A fair waiter also comes back within half its handover lease of its attempt's start, so
          // a lock handed to it is never older than that by its count when it gets the message (see
          // handedOver). Counted from the start, not the reply: after a reply Redis held up (a
          // pause, a fork) it comes back at once, or a lock handed over next would be counted from
          // that old start, and given back or lost early.
          const ttl = attempt.result.ttlMs;
          let bound = Math.min(ttl >= 0 ? ttl + 1 : 1_000, remaining);
          if (o.mode === 'write') bound = Math.min(bound, this.options.fairQueueTimeoutMs / 2);
          if (o.fair) bound = Math.min(bound, Math.max(0, attempt.start + this.handoverLeaseMs(o) / 2 - this.time.now()));
          const how = await watch.sleep(bound, sleep.signal);
          if (how === 'granted') {
            const handle = await this.handedOver(key, context, o, watch, attempt.start, started);
            if (handle) {
              granted = true;
              return handle;
            }
            continue;
          }
          if (how === 'aborted') o.signal?.throwIfAborted();
          woken = how === 'released';
          const handover = woken ? watch.takeHandover?.() : undefined;
          if (handover) {
            // Bounded as an attempt is: a grant that comes after the wait ended is given back.
            const handed = await this.bounded(handover, context.owner, key, o.mode, this.time.now(), deadline, (late) =>
              late && late !== 'unknown' ? this.giveBackHold(key, context.owner, o.mode) : undefined,
            );
            const handle = await this.takenOver(key, context, o, handed, started);
            if (handle) {
              woken = false;
              granted = true;
              return handle;
            }
          }
        }
      } finally {
        sleep.dispose();
        watch.close(woken);
        // A fair waiter that gives up leaves the queue, so nothing of it stays in Redis.
        if (!granted) await this.abandon(key, context.owner, o, watch.waitId);
      }
    } finally {
      this.acquisitionEnded(ids);
    }
  }

  /**
   * What ends a waiter's sleep early: the caller's `signal`, and shutdown. With a caller's signal,
   * a signal of the wait's own that either aborts; `dispose()`, when the wait ends, unhooks it from
   * both (the shutdown signal lives as long as this service: see anySignal).
   */
  private sleepSignal(o: ResolvedLockOptions): { signal: AbortSignal; dispose(): void } {
    return o.signal ? anySignal([o.signal, this.shutdown.signal]) : { signal: this.shutdown.signal, dispose: () => undefined };
  }

  private acquisitionStarted(ids: readonly string[]): void {
    for (const id of ids) this.acquiringIds.set(id, (this.acquiringIds.get(id) ?? 0) + 1);
  }

  private acquisitionEnded(ids: readonly string[]): void {
    for (const id of ids) {
      const left = this.acquiringIds.get(id)! - 1;
      if (left > 0) this.acquiringIds.set(id, left);
      else this.acquiringIds.delete(id);
    }
    if (--this.acquiring === 0) this.lastAcquisitionEnded?.();
  }

  /** Fair mode: the lease a release hands this waiter the lock with (at most the queue timeout, so a crashed waiter stalls the queue no longer than its place would). */
  private handoverLeaseMs(o: ResolvedLockOptions): number {
    return Math.min(o.leaseMs, this.options.fairQueueTimeoutMs);
  }

  /**
   * A fair release handed the lock to this waiter (no round trip of ours). Redis set the handover
   * lease at the release, which came after the start of our latest attempt (`attemptStart`): the
   * lease is counted from there. A grant already past that lease (this process was paused) is
   * given back (the hold the handover gave, and its mark, which names `watch`'s wait: the holds
   * other tasks or processes took under the same owner token stay) and undefined returned, so the caller tries
   * again. A fixed lease (no watchdog) longer than the handover lease is set in Redis before the
   * lock is handed out.
   */
  private async handedOver(key: string, context: LockContext, o: ResolvedLockOptions, watch: ReleaseWatch, attemptStart: number, started: number): Promise<LockHandle | undefined> {
    const handoverMs = this.handoverLeaseMs(o);
    const result = { granted: true as const, holdCount: 1, fencingToken: watch.grantedToken! };
    if (this.time.now() >= attemptStart + handoverMs - this.drift(handoverMs)) {
      // Only the hold the handover gave goes: those other tasks of the owner took stay theirs.
      await this.abandon(key, context.owner, o, watch.waitId);
      return undefined;
    }
    if (o.watchdog || handoverMs >= o.leaseMs) return this.granted(key, context, o, result, attemptStart, started, handoverMs);
    const start = this.time.now();
    const [kept] = await this.step(this.store.renew([{ key, owner: context.owner, leaseMs: o.leaseMs, mode: o.mode }])).catch(() => [false]);
    // Not kept: the handover was lost meanwhile; the next attempt says where things stand.
    return kept ? this.granted(key, context, o, result, start, started) : undefined;
  }

  /**
   * A release of this process handed the lock to this waiter (`handover`, see
   * ReleaseWatch.takeHandover): the handle, or undefined when it did not (the caller tries again at
   * once). A grant whose lease ran out before its reply was read (this process was paused) is given
   * back; after a failed release, whatever it may have granted this owner is given back (unless a
   * task of the same owner holds the lock here), and the caller's next attempt says where things stand.
   */
  private async takenOver(key: string, context: LockContext, o: ResolvedLockOptions, handover: Handover | undefined, started: number): Promise<LockHandle | undefined> {
    if (handover === undefined) return undefined;
    if (handover === 'unknown') {
      if (!this.holdsHere(context.owner, key, o.mode)) await this.step(this.giveBackOwn(key, context.owner, o.mode)).catch(() => undefined);
      return undefined;
    }
    if (this.leaseRanOut(handover.leaseStart, o) && (await this.givenBack(o, context.owner, [{ key, holdCount: 1 }]))) return undefined;
    return this.granted(key, context, o, { granted: true, holdCount: 1, fencingToken: handover.fencingToken }, handover.leaseStart, started);
  }

  /** One acquisition attempt of one key (see `bounded`). */
  private async attempt(
    key: string,
    owner: string,
    o: ResolvedLockOptions,
    deadline: number,
    waitId?: string,
    /** When the attempt started: Redis's lease counts from a moment after it. */
    start = this.time.now(),
  ): Promise<{ result: AcquireResult; start: number }> {
    const send = (): Promise<AcquireResult> => this.store.acquire(
      o.fair
        ? {
            key,
            owner,
            leaseMs: o.leaseMs,
            mode: o.mode,
            fair: true,
            queueTimeoutMs: this.options.fairQueueTimeoutMs,
            handoverLeaseMs: this.handoverLeaseMs(o),
            waitId,
            holdsHere: this.countHolds,
          }
        : { key, owner, leaseMs: o.leaseMs, mode: o.mode, queueTimeoutMs: this.options.fairQueueTimeoutMs, holdsHere: this.countHolds },
    );
    // An attempt given up on that Redis ran after all: a grant is given back, and a place it took
    // in a fair queue or among the waiting writers is left again. The leave the given-up wait sent
    // may have run before it: ioredis can send an unanswered command again after the commands
    // sent while it reconnected (see README, "When a step runs twice").
    const result = await this.bounded(send, owner, key, o.mode, start, deadline, (late) =>
      late.granted ? this.giveBackHold(key, owner, o.mode) : this.abandon(key, owner, o, waitId),
    );
    if (result.granted && this.leaseRanOut(start, o) && (await this.givenBack(o, owner, [{ key, holdCount: result.holdCount }]))) {
      return { result: { granted: false, ttlMs: 0 }, start };
    }
    return { result, start };
  }

  /**
   * Whether a grant from an attempt started at `start` came back after its own lease had run out
   * (this process was paused, or its event loop blocked, while the reply waited): another owner may
   * hold a key by now. Checked before `givenBack`, so an ordinary grant costs no promise.
   */
  private leaseRanOut(start: number, o: ResolvedLockOptions): boolean {
    return this.time.now() >= start + o.leaseMs;
  }

  /**
   * For a grant whose lease ran out (see leaseRanOut): never hand out a lock that is already lost.
   * When any key of the grant is fresh, give back what the attempt took (the fresh holds whole, one
   * hold of each re-entry) and report true, so the caller tries again like a contended attempt. A
   * stale re-entry alone is kept: it took no ownership.
   */
  private async givenBack(o: ResolvedLockOptions, owner: string, grants: readonly { key: string; holdCount: number }[]): Promise<boolean> {
    if (!grants.some((g) => g.holdCount === 1)) return false;
    await Promise.all(
      grants.map((g) => this.step<unknown>(g.holdCount === 1 ? this.giveBackOwn(g.key, owner, o.mode) : this.giveBackHold(g.key, owner, o.mode)).catch(() => undefined)),
    );
    return true;
  }

  /**
   * Waits for an acquisition request of `owner` on `keys` for the remaining wait, but never less
   * than stepTimeoutMs and the time the store may wait for replicas (confirmMs).
   * If Redis does not answer in time, the attempt is abandoned (LockBackendError); should it still
   * be granted later, `giveBack` returns that grant at once so no orphan lock stays until its lease ends.
   * `send` (an attempt not sent yet) goes only once every attempt of the owner on these keys that
   * was abandoned so far has been answered and given back (see givenUp); it is not sent at all if
   * its own bound passes first. A request already sent (a handover) is not held back.
   */
  private bounded<R>(
    send: (() => Promise<R>) | Promise<R>,
    owner: string,
    keys: string | readonly string[],
    mode: LockMode,
    start: number,
    deadline: number,
    giveBack: (late: R) => unknown,
  ): Promise<R> {
    const limit = Math.max(deadline - start, this.stepLimitMs());
    let abandoned = false;
    let request: Promise<R>;
    if (typeof send !== 'function') request = send;
    else {
      const earlier = this.givenUp.size > 0 ? this.unansweredBefore(owner, keys, mode) : undefined;
      request = earlier
        ? earlier.then(() => {
            if (abandoned) throw new AttemptTimeout(limit);
            return send();
          })
        : send();
    }
    return withTimeout(request, limit, () => new AttemptTimeout(limit), this.time).catch((error: unknown) => {
      if (error instanceof AttemptTimeout) {
        abandoned = true;
        this.noteGivenUp(owner, keys, mode, request.then(giveBack, () => undefined).then(() => undefined, () => undefined));
      }
      // Our own errors (a replica shortfall, a Redlock quorum) say more than a wrapper would.
      if (error instanceof LockError) throw error;
      throw new LockBackendError('acquire', typeof keys === 'string' ? keys : keys.join(', '), error);
    });
  }

  /** What an attempt of `owner` on `keys` waits for before it is sent: the abandoned attempts there not answered yet (see givenUp). */
  private unansweredBefore(owner: string, keys: string | readonly string[], mode: LockMode): Promise<unknown> | undefined {
    if (typeof keys === 'string') return this.givenUp.get(heldLockId(owner, keys, mode));
    const pending = keys.map((key) => this.givenUp.get(heldLockId(owner, key, mode))).filter((p) => p !== undefined);
    return pending.length === 0 ? undefined : Promise.all(pending);
  }

  /** Records an abandoned attempt until `answered` settles (its reply came and a late grant was given back). */
  private noteGivenUp(owner: string, keys: string | readonly string[], mode: LockMode, answered: Promise<void>): void {
    for (const key of typeof keys === 'string' ? [keys] : keys) {
      const id = heldLockId(owner, key, mode);
      const before = this.givenUp.get(id);
      const entry = before ? Promise.all([before, answered]).then(() => undefined) : answered;
      this.givenUp.set(id, entry);
      void entry.then(() => {
        if (this.givenUp.get(id) === entry) this.givenUp.delete(id);
      });
    }
  }

  private granted(
    key: string,
    context: LockContext,
    o: ResolvedLockOptions,
    result: AcquireResult & { granted: true },
    leaseStart: number,
    started: number,
    /** A fair handover: Redis holds the lock for this long from `leaseStart`, until the watchdog renews it to `o.leaseMs`. */
    handoverMs?: number,
  ): LockHandle {
    if (this.closing) {
      // Shutdown began while this attempt was in flight: give the grant back (sent before the
      // connection closes, which waits for acquisitions in progress) and fail like any acquisition now.
      void this.givenBack(o, context.owner, [{ key, holdCount: result.holdCount }]);
      throw shutDown(key);
    }
    if (this.unavailableLog.active) this.unavailableLog.recovered();
    const id = heldLockId(context.owner, key, o.mode);
    let lock = this.held.get(id);
    if (lock && result.holdCount > 1) {
      lock.holds++;
      if (!lock.watchdog && leaseStart + o.leaseMs > lock.deadline) {
        lock.setLease(leaseStart, o.leaseMs);
        this.watchdog.touch(lock);
      }
      this.emit({ type: 'reentered', key, owner: context.owner, holdCount: result.holdCount });
    } else {
      // A record without a matching hold in Redis means the old grant was lost unnoticed.
      if (lock) void this.markLost(lock, 'taken');
      // fencingTokens: false: no grant carries a token, whatever the store returned (a fair handover's, the memory store's).
      const fencingToken = this.options.fencingTokens ? result.fencingToken : Number.NaN;
      lock = new HeldLock(id, key, context.owner, o.leaseMs, o.watchdog, fencingToken, leaseStart, o.mode, this.drift, o.fair, this.time.now);
      if (handoverMs !== undefined && handoverMs < o.leaseMs) lock.shortenFirstLease(leaseStart, handoverMs);
      this.held.set(lock.id, lock);
      this.watchdog.add(lock);
      // Events are built only when someone subscribed (this runs on every acquisition).
      if (this.events.observed) {
        this.emit(
          result.holdCount > 1
            ? { type: 'reentered', key, owner: context.owner, holdCount: result.holdCount }
            : { type: 'acquired', key, owner: context.owner, waitedMs: this.time.now() - started, fencingToken },
        );
      }
    }
    return new LockHandle(this, lock, context, result.holdCount);
  }

  /** @internal */
  checkDeadline(lock: HeldLock): void {
    if (!lock.lost && lock.holds > 0 && lock.deadline <= this.time.now()) void this.markLost(lock, 'lease-expired');
  }

  /** @internal */
  async releaseHandle(lock: HeldLock, keepMs = 0, context?: LockContext): Promise<void> {
    if (lock.lost) return;
    lock.holds--;
    // Stop renewing before the release is sent: no renewal can follow it.
    if (lock.holds === 0) this.forget(lock);
    // A waiter of this process the release takes along acquires only once this release is recorded.
    const takeAlong = lock.holds === 0 && !lock.fair && keepMs <= 0 ? new ReleaseNotice() : undefined;
    let left: number;
    try {
      try {
        if (lock.holds === 0 && keepMs > 0) {
          // minHoldMs: leave the lock in Redis as a fixed lease of keepMs instead of deleting it.
          const leaseMs = Math.ceil(keepMs);
          const sent = this.time.now();
          const [kept] = await this.step(this.store.renew([{ key: lock.key, owner: lock.owner, leaseMs, mode: lock.mode, exact: true, holdsAtMost: this.sharedHolds(lock.owner, 1) }]));
          left = kept ? 0 : -1;
          if (kept && lock.mode !== 'read' && (this.holdsHere(lock.owner, lock.key, 'read') || (context && this.ownerGoesOn(context)))) this.keepHold(lock, sent + leaseMs);
        } else {
          left = await this.step(this.store.release(lock.key, lock.owner, lock.mode, takeAlong, this.countHolds, lock.holds > 0));
        }
      } catch (error) {
        const failure = new LockBackendError('release', lock.key, error);
        this.emit({ type: 'release-failed', key: lock.key, owner: lock.owner, error: failure });
        throw failure;
      }
      // Redis no longer listed us (left < 0): the lock had been lost before we noticed. Or this
      // release freed it while this process still counts holds of an owner it made, which no other
      // process uses: the Redis stores keep such a lock (see LockStore.release's stillHeld) and the
      // memory store never counts fewer holds than this process, so this is a safeguard; the other
      // handles must know at once.
      if (left < 0 || (left === 0 && lock.holds > 0 && this.madeHere(lock.owner))) {
        void this.markLost(lock, 'taken');
        return;
      }
      if (this.events.observed) this.emit({ type: 'released', key: lock.key, owner: lock.owner, holdCount: left, heldMs: lock.heldMs });
    } finally {
      takeAlong?.recorded();
    }
  }

  /**
   * The last hold of a write (or exclusive) lock is kept in Redis until `until` (minHoldMs), and its
   * owner holds the lock's read side, or may take it before then (its context goes on: see
   * ownerGoesOn). Redis keeps one lease for both sides, which the read side's renewals keep alive,
   * so the kept hold would stay as long as the read side is held, and its lease after, keeping
   * readers out. A timer gives it back at `until` (the service's clock); at shutdown it is left
   * alone in Redis for the rest of its time (see close).
   */
  private keepHold(lock: HeldLock, until: number): void {
    // Shutting down: its lease frees it (no timer outlives the service).
    if (this.closing) return;
    const hold: KeptHold = { key: lock.key, owner: lock.owner, mode: lock.mode, until, timer: undefined };
    hold.timer = this.time.setTimeout(() => {
      this.kept.delete(hold);
      // Bounded like a release: a Redis that stops answering is logged after stepTimeoutMs, not when the connection closes.
      void this.step(this.giveBackHold(hold.key, hold.owner, hold.mode)).then(
        () => {
          if (this.releaseFailureLog.active) this.releaseFailureLog.recovered();
        },
        (error: unknown) =>
          this.releaseFailureLog.failed(`could not give back the hold kept for minHoldMs of "${hold.key}"; it stays until the lock's lease ends: ${String(new LockBackendError('release', hold.key, error))}`),
      );
    }, Math.max(0, until - this.time.now()));
    hold.timer.unref();
    this.kept.add(hold);
  }

  /**
   * Whether the owner of `context` (the context a hold was taken in) goes on after that hold: a lock
   * of an outer context is still held (as `current()` finds it), or the owner was given by name.
   */
  private ownerGoesOn(context: LockContext): boolean {
    return !this.madeHere(context.owner) || innermostHeld(context) !== undefined;
  }

  /**
   * At shutdown, for a lock still held: whether it stays in Redis for a while instead of being taken
   * back, because a `@Locked` call with `minHoldMs` took it (holdAtLeast), or a hold of it kept for
   * `minHoldMs` is waiting for its timer (the owner took the lock again since). Then it becomes one
   * kept hold, whole (every hold of the owner), until the later of the two, which settleKeptHolds
   * sets as its lease.
   */
  private keptAtShutdown(lock: HeldLock): boolean {
    // An owner given by name may hold the lock in other processes too: a fixed lease set here
    // would cut theirs, so this process gives back its own holds instead (see giveBackOwn).
    if (!this.madeHere(lock.owner)) return false;
    let until = lock.keepUntil;
    for (const hold of this.kept) {
      if (hold.key !== lock.key || hold.owner !== lock.owner || hold.mode !== lock.mode) continue;
      until = Math.max(until, hold.until);
      if (hold.timer) this.time.clearTimeout(hold.timer);
      this.kept.delete(hold);
    }
    if (until <= this.time.now()) return false;
    this.kept.add({ key: lock.key, owner: lock.owner, mode: lock.mode, until, timer: undefined, whole: true });
    return true;
  }

  /** At shutdown, after the read sides were taken back: each kept hold stays alone for the rest of its `minHoldMs`. */
  private settleKeptHolds(): Promise<unknown> {
    return Promise.all(
      [...this.kept].map((hold) => {
        this.kept.delete(hold);
        if (hold.timer) this.time.clearTimeout(hold.timer);
        const leaseMs = Math.ceil(hold.until - this.time.now());
        const settle =
          leaseMs > 0
            ? this.store.renew([{ key: hold.key, owner: hold.owner, leaseMs, mode: hold.mode, exact: true, holdsAtMost: this.sharedHolds(hold.owner, 1) }])
            : hold.whole
              ? this.store.releaseAll(hold.key, hold.owner, hold.mode)
              : this.giveBackHold(hold.key, hold.owner, hold.mode);
        return settle.catch(() => undefined);
      }),
    );
  }

  /** @internal */
  async extendHandle(lock: HeldLock, leaseMs: number, handle: LockHandle): Promise<void> {
    duration(leaseMs ?? null, 'leaseMs', 'LockHandle.extend()', { min: MIN_LEASE_MS, fallback: 0 });
    if (lock.lost) throw lock.signal.reason as Error;
    if (handle.released) {
      throw new LockError(`LockHandle.extend(): the handle of "${lock.key}" was already released; acquire the lock again.`);
    }
    const start = this.time.now();
    let ok: boolean | undefined;
    try {
      [ok] = await this.step(this.store.renew([{ key: lock.key, owner: lock.owner, leaseMs, mode: lock.mode, exact: true, holdsAtMost: this.sharedHolds(lock.owner, lock.holds) }]));
    } catch (error) {
      throw new LockBackendError('extend', lock.key, error);
    }
    if (!ok) {
      await this.markLost(lock, 'taken');
      throw lock.signal.reason as Error;
    }
    lock.setLease(start, leaseMs);
    this.watchdog.touch(lock);
  }

  /**
   * An acquisition that would wait found `key` held. If the holder is the calling context itself, through another
   * LockService of this application (`LockModule.forRoot()` imported more than once: each import has a
   * service of its own, and a lock is reentrant only through the service that took it), waiting
   * would wait for the caller's own lock until `waitMs` ran out: fail at once, saying what to fix.
   * Asks Redis only when another service holds `key` in the calling context, so that a lock of
   * another service on another Redis (the same key name, another lock) is never taken for it.
   */
  private async refuseOwnLock(key: string, owner: string, o: ResolvedLockOptions): Promise<void> {
    let outer: LockHandle | undefined;
    for (const other of this.others()) if ((outer = other.current(key))) break;
    if (!outer) return;
    // A lost lock's owner holds nothing in Redis: the check below lets the wait go on.
    const state = await this.step(this.store.inspect(key, outer.owner, outer.lock.mode)).catch(() => undefined);
    if (!state || state.holdCount === 0) return;
    await this.abandon(key, owner, o);
    throw new LockConfigurationError(
      'LockModule',
      `Lock "${key}" is held by this same call, through another LockService: LockModule.forRoot() is imported more than once in this application, each import makes a LockService of its own, and a lock is reentrant only through the LockService that took it, so this acquisition would wait for its own caller's lock. ` +
        IMPORT_ONCE,
    );
  }

  /**
   * The other LockServices of this application not yet shut down (each import of `LockModule.forRoot()`
   * makes one). Asked of Nest when needed, not kept anywhere: another application of this process
   * is never seen, and a module loaded lazily is.
   */
  private others(): LockService[] {
    return this.all().filter((other) => other !== this && !other.closing);
  }

  /** Every LockService of this application, this one included, in Nest's module order ([] without Nest). */
  private all(): LockService[] {
    try {
      return (this.moduleRef?.get(LockService, { strict: false, each: true }) ?? []).filter((s) => s instanceof LockService);
    } catch {
      return [];
    }
  }

  /**
   * Gives back what this process holds of a lock and will not use: a fresh grant it will not hand
   * out (stale, or from a release that failed), or a lost lock's `holds` (markLost). Every hold of
   * an owner this service made, which no other process uses (a resent acquisition may have counted
   * one twice); of an owner given by name, this process's `holds` only, one release each (sent
   * together, so they reach Redis in a row), since another process may hold the lock under that
   * name too, in the same hash field (a hand-over: see the README's owners).
   */
  private giveBackOwn(key: string, owner: string, mode: LockMode, holds = 1): Promise<unknown> {
    if (this.madeHere(owner)) return this.store.releaseAll(key, owner, mode);
    return Promise.all(Array.from({ length: holds }, () => this.giveBackHold(key, owner, mode)));
  }

  /**
   * Gives back one hold of a grant this process did not count (a late grant, or one whose lease ran
   * out): the release may free the lock only when this process holds nothing of it, and is
   * corrected, if it ran twice, against the holds this process counts.
   */
  private giveBackHold(key: string, owner: string, mode: LockMode): Promise<number> {
    return this.store.release(key, owner, mode, undefined, this.countHolds, this.holdsHere(owner, key, mode));
  }

  /** Whether this service holds `key` in `mode` for `owner` (fair mode tells Redis, to tell a handover from a re-entry). */
  private holdsHere(owner: string, key: string, mode: LockMode): boolean {
    return this.held.has(heldLockId(owner, key, mode));
  }

  /**
   * The stores' HoldsHere: for an owner this service made for a context, which no other process
   * uses (unless given its name), the holds this process counts are all the holds Redis has.
   */
  private readonly countHolds: HoldsHere = (owner, key, mode) =>
    this.madeHere(owner) ? (this.held.get(heldLockId(owner, key, mode))?.holds ?? 0) : undefined;

  /**
   * For a lease set exactly (RenewRequest.holdsAtMost): `holds`, this process's holds of an owner
   * given by name, beyond which another process holds the lock under that name too and counts on
   * its lease; undefined for an owner this service made.
   */
  private sharedHolds(owner: string, holds: number): number | undefined {
    return this.madeHere(owner) ? undefined : holds;
  }

  /** Whether this service made `owner` for a context (see contextFor): then no other process uses it. */
  private madeHere(owner: string): boolean {
    return owner.startsWith(this.ownerPrefix);
  }

  /**
   * A waiter gave up: it leaves the fair queue or the waiting writers, so nothing of it stays. A
   * lock handed to its wait `waitId` (none before it watched the key) is given back.
   */
  private async abandon(key: string, owner: string, o: ResolvedLockOptions, waitId?: string): Promise<void> {
    if (!o.fair && o.mode !== 'write') return;
    await this.step(this.store.abandon(key, owner, o.mode, o.fair, waitId)).catch(() => undefined);
  }

  /**
   * @internal A `@Locked` call with `minHoldMs` took `held`: each lock it took fresh (not a
   * re-entry, which `minHoldMs` leaves alone) stays in Redis at shutdown until `minHoldMs` after it
   * was taken (see keptAtShutdown), as it would have had the call ended then.
   */
  holdAtLeast<T extends LockHandle | LockGroup>(held: T, minHoldMs: number): T {
    for (const handle of held instanceof LockGroup ? held.handles : [held as LockHandle]) {
      if (handle.holdCount === 1) handle.lock.keepUntil = handle.lock.acquiredAt + minHoldMs;
    }
    return held;
  }

  /** @internal Releases without throwing (run() and `@Locked` must not let a failed release replace the result). */
  async releaseQuietly(handle: LockHandle | LockGroup, minHoldMs = 0): Promise<void> {
    if (handle instanceof LockGroup) {
      handle.detach();
      // All at once, as LockGroup.release: a frozen Redis holds the group up no longer than one lock.
      await Promise.all([...handle.handles].reverse().map((member) => this.releaseQuietly(member, minHoldMs)));
      return;
    }
    try {
      const keepMs = minHoldMs - handle.lock.heldMs;
      if (keepMs > 0 && handle.holdCount === 1) await handle.releaseAfter(keepMs);
      else await handle.release();
      if (this.releaseFailureLog.active) this.releaseFailureLog.recovered();
    } catch (error) {
      this.releaseFailureLog.failed(`could not release "${handle.key}"; its lease will free it: ${String(error)}`);
    }
  }

  private forget(lock: HeldLock): void {
    this.watchdog.remove(lock);
    if (this.held.get(lock.id) === lock) this.held.delete(lock.id);
  }

  /**
   * The lock is not ours any more: forget it, report it once, abort its signal. When our hold may
   * still be in Redis (the lease ran out locally, or shutdown), take it back so it does not linger;
   * that command is sent before anything else this owner could send for the key from now on.
   *
   * Not when the lease ran out while this owner is acquiring the same lock again (a re-entry whose
   * attempt is in flight, or a wait): Redis runs the take-back after that attempt, or after a
   * handover to that wait, and would delete the hold it granted, which the owner then believes it
   * has while another owner takes the lock. The old hold then lasts until its lease ends in Redis
   * (at once, unless a renewal ran there that the watchdog did not hear back from). At shutdown the
   * take-back is sent anyway: a grant that comes back then is given back too (see `granted`).
   */
  private markLost(lock: HeldLock, reason: LockLossReason): Promise<void> {
    if (lock.lost) return Promise.resolve();
    const error = new LockLostError(lock.key, lock.owner, reason, lock.heldMs);
    lock.setLost(error);
    this.forget(lock);
    const cleanup =
      reason === 'taken' || (reason === 'lease-expired' && this.acquiringIds.has(lock.id)) || (reason === 'shutdown' && this.keptAtShutdown(lock))
        ? Promise.resolve()
        : this.giveBackOwn(lock.key, lock.owner, lock.mode, lock.holds).then(
            () => undefined,
            () => undefined,
          );
    if (reason === 'shutdown') this.logger.debug(error.message);
    else this.logger.warn(error.message);
    this.emit({ type: 'lost', key: lock.key, owner: lock.owner, reason, heldMs: error.heldMs, error });
    lock.abort();
    return cleanup;
  }

  private async inspect(key: string, owner: string | undefined, operation: string, mode?: LockMode) {
    try {
      return await this.step(this.store.inspect(key, owner, mode));
    } catch (error) {
      throw new LockBackendError(operation, key, error);
    }
  }

  /**
   * A step a caller awaits (a release, extend(), a read, a force-unlock, leaving a queue), bounded
   * by the module's stepTimeoutMs plus the store's confirmMs (Redlock bounds its steps per node): a
   * Redis that stops answering (frozen, or cut off with no reset) must not hold up the handler's
   * result, which ioredis would do until the connection closes. A step given up on may still run
   * later, and each of these is safe late: a release or renewal names its owner, whose later steps
   * on the same connection come after it.
   */
  private step<T>(request: Promise<T>): Promise<T> {
    if (this.store.boundsSteps) return request;
    const limit = this.stepLimitMs();
    return withTimeout(request, limit, () => new AttemptTimeout(limit), this.time);
  }

  /** How long a step waits for Redis: the module's stepTimeoutMs plus the store's confirmMs (its wait for replicas). */
  private stepLimitMs(): number {
    return this.options.stepTimeoutMs + (this.store.confirmMs ?? 0);
  }

  private emit(event: LockEvent): void {
    if (this.events.observed) this.events.next(event);
  }

  private close(): Promise<void> {
    this.closing ??= (async () => {
      this.watchdog.stop();
      // Waiters wake and fail with the shutdown error, leaving fair queues and waiting writers first;
      // an attempt in flight that comes back granted gives its grant back (see granted()).
      this.shutdown.abort();
      const acquisitionsEnded = this.acquiring === 0 ? undefined : new Promise<void>((resolve) => (this.lastAcquisitionEnded = resolve));
      const releases = Promise.all([...this.held.values()].map((lock) => this.markLost(lock, 'shutdown'))).then(() => this.settleKeptHolds());
      await withTimeout(Promise.all([releases, acquisitionsEnded]), SHUTDOWN_RELEASE_MS, () => new Error('timeout')).catch(() => undefined);
      await this.store.close();
      this.events.complete();
    })();
    return this.closing;
  }
}

/**
 * The innermost handle not yet released in `context` and the contexts around it (`run()`, a
 * `@Locked` method, `handle.run()`, a multi-key group's handles), or the innermost one on `key`.
 */
function innermostHeld(context: LockContext | undefined, key?: string): LockHandle | undefined {
  for (let c = context; c; c = c.parent) {
    const candidates = c.group ? c.group.handles : c.handle ? [c.handle] : [];
    const match = candidates.find((h) => !h.released && (key === undefined || h.key === key));
    if (match) return match;
  }
  return undefined;
}

/** A hold kept for `minHoldMs` that a timer gives back (see LockService.keepHold). */
interface KeptHold {
  key: string;
  owner: string;
  mode: LockMode;
  /** When `minHoldMs` is up, on the service's clock. */
  until: number;
  timer: Timer | undefined;
  /** Every hold of the owner, not one (a lock still held at shutdown: see keptAtShutdown). */
  whole?: boolean;
}

/** What `LockService.health()` reports. */
export interface LockHealth {
  status: 'up' | 'down';
  /** Where the locks live. */
  store: string;
  /** Locks this service holds now. */
  heldLocks: number;
  /** How late the most overdue renewal is, in ms. */
  renewalOverdueMs: number;
  /** Why the store is down. */
  error?: string;
}

/** @internal */
export interface LockedPlan {
  policy: ContentionPolicy;
  minHoldMs: number;
  acquire: ResolvedLockOptions;
}

function unlimitedListeners(controller: AbortController): AbortController {
  setMaxListeners(0, controller.signal);
  return controller;
}

/** What an acquisition gets once the module has shut down (or while it shuts down, for a waiter). */
function shutDown(key: string): LockBackendError {
  return new LockBackendError(
    'acquire',
    key,
    new Error('the lock module has shut down'),
    `Cannot acquire "${key}": the lock module has shut down (the application is closing). Take locks only while the application runs.`,
  );
}

class AttemptTimeout extends Error {
  constructor(ms: number) {
    super(`no answer within ${Math.round(ms)} ms`);
  }
}

/**
 * LockStore.release's `takeAlong`: `noticed` resolves once the release is recorded. The promise is
 * made only when a store reads it (a release that takes a waiter along), not on every release.
 */
class ReleaseNotice implements TakeAlong {
  private done = false;
  private promise: Promise<void> | undefined;
  private resolve: (() => void) | undefined;

  get noticed(): Promise<void> {
    this.promise ??= this.done ? Promise.resolve() : new Promise<void>((resolve) => (this.resolve = resolve));
    return this.promise;
  }

  recorded(): void {
    this.done = true;
    this.resolve?.();
  }
}
