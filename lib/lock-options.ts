import type { Cluster, ClusterNode, ClusterOptions, Redis, RedisOptions } from 'ioredis';
import { LockConfigurationError } from './errors/lock-configuration.error.js';
import type { LockMode } from './store/lock-store.js';
import { FENCE_COUNTER_TTL_MS } from './store/redis/lock.scripts.js';
import { DEFAULT_FAIR_QUEUE_TIMEOUT_MS } from './lock.constants.js';
import { redactUrls } from './internal/redact.js';

/** The longest delay a Node timer can express (about 24.8 days). Durations are capped to it. */
export const MAX_DURATION_MS = 2_147_483_647;
/** The shortest lease accepted. Shorter leases cannot be renewed reliably over a network. */
export const MIN_LEASE_MS = 100;
/** The default `stepTimeoutMs`: how long a lock step waits for Redis before it gives up. */
const DEFAULT_STEP_TIMEOUT_MS = 1_000;
/** The shortest `stepTimeoutMs`: a bound under a round trip or two would give up on a Redis that merely answers. */
const MIN_STEP_TIMEOUT_MS = 100;
/** The shortest `fencingCounterTtlMs`: tokens stay increasing only across clock steps back shorter than it. */
export const MIN_FENCING_COUNTER_TTL_MS = 1_000;

/**
 * Options of `LockModule.forRoot()`. Every field is optional.
 *
 * @example
 * LockModule.forRoot({ redis: 'redis://127.0.0.1:6379', keyPrefix: 'orders:lock:', waitMs: 2_000 })
 */
export interface LockModuleOptions {
  /**
   * Where Redis is: a `redis://` / `rediss://` URL, ioredis `RedisOptions` (including Sentinel's
   * `sentinels` + `name`), an ioredis `Redis` or `Cluster` client you created, or
   * `{ cluster: [nodes], options? }` for a Redis Cluster. A client you pass in is never closed by
   * nestjs-locked; one it creates is closed on shutdown. Default: `redis://127.0.0.1:6379`.
   * See the README's topology table.
   */
  redis?: RedisConnection;
  /**
   * Where the locks live: `'redis'` (default), or `'memory'`, an in-process store with the same
   * semantics for tests and single-process apps. A memory store protects nothing across
   * processes; `redis` is ignored with it. `LockTestingModule.forRoot()` chooses it for you.
   */
  store?: 'redis' | 'memory';
  /** Prefix of every Redis key the module writes. Default `lock:`. Must not contain `{` or `}`. */
  keyPrefix?: string;
  /**
   * Lease of a lock in milliseconds: how long Redis keeps it if its holder stops renewing it (the
   * process died, the network broke). Default 30 000. Renewed every third of it while held, unless
   * `watchdog` is false.
   */
  leaseMs?: number;
  /** Renew held locks while they are held. Default `true`. */
  watchdog?: boolean;
  /** How long `acquire()` and `run()` wait for a held lock before failing, in ms. Default 10 000. `Infinity` waits for ever. */
  waitMs?: number;
  /**
   * At bootstrap, wait this long (ms) for Redis to answer and load the lock scripts, and fail
   * start-up if it does not. `0` skips the check. Default 10 000.
   */
  connectTimeoutMs?: number;
  /**
   * How long a lock step waits for Redis to answer before it gives up, in ms: a release,
   * `extend()`, `isLocked()`, `holdCount()`, `remainingTtl()`, `forceUnlock()`, and a waiter leaving
   * its queue; an acquisition attempt waits the rest of its `waitMs`, but never less than this. A
   * step given up on rejects with `LockBackendError` (`run()` and `@Locked` then log the failed
   * release and return the handler's result); Redis still runs it if it comes back. Renewals are
   * not bounded by it (the lease deadline is their bound). With `replication`, each bound grows by
   * 2 × its `timeoutMs`; under `redlock` it bounds each node's answer, and a node's acquisition
   * attempt waits at most half of it. Default 1 000; from 100.
   */
  stepTimeoutMs?: number;
  /** What a `@Locked` method does when another owner holds its lock. Default `'wait'`. */
  onContention?: ContentionPolicy;
  /** Default `minHoldMs` of `@Locked` methods (not of read locks). Default 0. */
  minHoldMs?: number;
  /** The HTTP status of a `@Locked` controller handler that could not get its lock: 409 (default) or 423. */
  contendedHttpStatus?: 409 | 423;
  /**
   * Fair mode: how long a waiter keeps its place in the queue without a new attempt (waiters retry
   * every half of min(lease, this) while they wait), and the longest lease a release hands the next
   * waiter the lock with. A waiter that crashed stalls the queue at most twice this long.
   * Default 5 000.
   */
  fairQueueTimeoutMs?: number;
  /**
   * How long a key's fencing counter (`P{K}:fence`) stays in Redis after the key's last grant, in
   * ms. Default 3 600 000 (an hour); at least 1 000. Every key locked within it keeps about 150
   * bytes in Redis, so an app that locks many distinct keys may want it shorter; fencing tokens
   * keep increasing as long as Redis's clock does not step back by more than it. Not with `redlock`,
   * which keeps no counters; ignored by the memory store.
   */
  fencingCounterTtlMs?: number;
  /**
   * Whether grants issue fencing tokens. Default true. False when no resource you protect checks
   * them: a grant then skips the counter (one Redis TIME and one SET per fresh grant), and keys
   * keep nothing in Redis after their release (fair locks excepted: their handovers keep using
   * counters). `LockHandle.fencingToken` then throws `LockConfigurationError`, and events carry
   * `NaN`. Not together with `fencingCounterTtlMs`; with `redlock` it can only be false.
   */
  fencingTokens?: boolean;
  /**
   * Replica confirmation (Redis `WAIT`) on a single server or a Sentinel-managed master: after every
   * acquire, renew and release, wait until `replicas` replicas acknowledged it, at most `timeoutMs`.
   * Not available on Redis Cluster or with `redlock`. See the README's topology table.
   */
  replication?: ReplicationOptions;
  /**
   * The Redlock quorum over independent Redis masters (3 or 5, never replicas of each other):
   * a lock is held when a majority of them granted it within its validity. Replaces `redis`.
   */
  redlock?: RedlockOptions;
}

/** Replica confirmation with Redis `WAIT` (see `LockModuleOptions.replication`). */
export interface ReplicationOptions {
  /** How many replicas must acknowledge each step. At least 1. */
  replicas: number;
  /**
   * How long to wait for them, in ms. Default 100. `WAIT` blocks the lock connection meanwhile;
   * steps confirmed in the same turn of the event loop share one `WAIT`.
   */
  timeoutMs?: number;
  /**
   * What to do with an acquisition fewer replicas acknowledged in time: `'rollback'` (default)
   * gives it back and rejects with `LockReplicationError`; `'keep'` keeps it and logs a warning.
   */
  onUnconfirmedAcquire?: 'rollback' | 'keep';
}

/** The Redlock quorum (see `LockModuleOptions.redlock`). */
export interface RedlockOptions {
  /** The independent masters: URLs, ioredis options or ioredis clients. At least 3; an odd number. */
  clients: (string | RedisOptions | Redis)[];
  /**
   * Clock drift allowance as a share of the lease (default 0.01): a grant is valid for
   * lease − time spent acquiring − lease × driftFactor − 2 ms.
   */
  driftFactor?: number;
}

/**
 * What a `@Locked` method does when another owner holds its lock:
 * - `'wait'`: wait up to `waitMs`, then fail with `LockNotAcquiredError` (HTTP 409 in controllers);
 * - `'fail'`: fail at once with `LockNotAcquiredError`;
 * - `'skip'`: do not run the method, resolve to `undefined` (for scheduled jobs: another instance runs this tick).
 */
export type ContentionPolicy = 'wait' | 'fail' | 'skip';

/**
 * Options of `@Locked(template, options)`. Unset fields take the module's values.
 *
 * @example
 * @Cron('0 * * * * *')
 * @Locked('report:hourly', { onContention: 'skip', minHoldMs: 5_000 })
 * async hourlyReport() {}
 */
export interface LockedOptions {
  /** How long to wait for the lock when `onContention` is `'wait'`, in ms. */
  waitMs?: number;
  /** A fixed lease in ms (turns the watchdog off unless `watchdog: true`). */
  leaseMs?: number;
  /** Renew the lock while the method runs. */
  watchdog?: boolean;
  /** What to do when another owner holds the lock. Default: the module's `onContention` (`'wait'`). */
  onContention?: ContentionPolicy;
  /** First come, first served across processes (see `LockOptions.fair`). */
  fair?: boolean;
  /** A side of a read-write lock (see `LockOptions.mode`). */
  mode?: 'read' | 'write';
  /**
   * Keep the lock at least this long after it was taken, even if the method finished sooner (as
   * ShedLock's lockAtLeastFor): an instance whose trigger fires a little later then skips the same
   * tick instead of running it again. The rest of the time is left as a fixed lease in Redis.
   * Exclusive and write locks only: refused with `mode: 'read'`, and the module's default does not
   * apply to read locks.
   */
  minHoldMs?: number;
}

/**
 * Options of one `acquire()`, `tryAcquire()` or `run()` call. Unset fields take the module's values.
 */
export interface LockOptions {
  /** How long to wait for a held lock, in ms. `0` makes one attempt. `Infinity` waits for ever. */
  waitMs?: number;
  /**
   * A fixed lease in ms. Giving `leaseMs` here turns the watchdog off for this lock (as in
   * Redisson): the lock ends after `leaseMs` unless released or extended earlier. Add
   * `watchdog: true` to keep renewing with this lease instead.
   */
  leaseMs?: number;
  /** Renew this lock while it is held. Default: the module's `watchdog`, or `false` when `leaseMs` is given. */
  watchdog?: boolean;
  /**
   * An explicit owner token instead of the current execution context. Two calls with the same
   * token, in one process or several, are the same owner and re-enter each other's lock. Use it to
   * hand a lock from one process to another. At most 256 characters, not starting with `:` nor
   * ending with `:read` (nestjs-locked's own hash fields); refused with `LockConfigurationError`.
   */
  owner?: string;
  /** Stop waiting when this signal aborts; the acquisition then rejects with the signal's reason. */
  signal?: AbortSignal;
  /**
   * First come, first served across processes: waiters queue in Redis in the order of their first
   * attempt, and a release hands the lock to the head of the queue in the same step (the waiter
   * holds it without a round trip of its own). Use it for every acquisition of a key, or for none:
   * a non-fair acquisition does not look at the queue.
   */
  fair?: boolean;
  /**
   * A side of a read-write lock: many readers or one writer per key. Without it the lock is a plain
   * exclusive lock (which excludes readers and writers alike).
   */
  mode?: 'read' | 'write';
}

/** Where Redis is (see `LockModuleOptions.redis`). */
export type RedisConnection = string | RedisOptions | Redis | Cluster | RedisClusterConnection;

/** A Redis Cluster nestjs-locked connects to itself: its startup nodes and ioredis `ClusterOptions`. */
export interface RedisClusterConnection {
  cluster: ClusterNode[];
  options?: ClusterOptions;
}

/** Module options after defaults and validation. */
export interface ResolvedModuleOptions {
  store: 'redis' | 'memory';
  redis: RedisConnection;
  keyPrefix: string;
  leaseMs: number;
  watchdog: boolean;
  waitMs: number;
  connectTimeoutMs: number;
  stepTimeoutMs: number;
  onContention: ContentionPolicy;
  minHoldMs: number;
  contendedHttpStatus: 409 | 423;
  fairQueueTimeoutMs: number;
  fencingCounterTtlMs: number;
  fencingTokens: boolean;
  replication: Required<ReplicationOptions> | undefined;
  redlock: Required<RedlockOptions> | undefined;
}

/** Per-call options after defaults and validation. */
export interface ResolvedLockOptions {
  waitMs: number;
  leaseMs: number;
  watchdog: boolean;
  owner: string | undefined;
  signal: AbortSignal | undefined;
  fair: boolean;
  mode: LockMode;
}

const MODULE_OPTION_NAMES = [
  'store',
  'redis',
  'keyPrefix',
  'leaseMs',
  'watchdog',
  'waitMs',
  'connectTimeoutMs',
  'stepTimeoutMs',
  'onContention',
  'minHoldMs',
  'contendedHttpStatus',
  'fairQueueTimeoutMs',
  'fencingCounterTtlMs',
  'fencingTokens',
  'replication',
  'redlock',
] as const;
const LOCKED_OPTION_NAMES = ['waitMs', 'leaseMs', 'watchdog', 'onContention', 'minHoldMs', 'fair', 'mode'] as const;
const CONTENTION_POLICIES: readonly ContentionPolicy[] = ['wait', 'fail', 'skip'];
const LOCK_OPTION_NAMES = ['waitMs', 'leaseMs', 'watchdog', 'owner', 'signal', 'fair', 'mode'] as const;
const HOLD_COUNT_OPTION_NAMES = ['owner', 'mode'] as const;
const MAX_OWNER_LENGTH = 256;
const MAX_PREFIX_LENGTH = 256;

/** Whether `value` can be read as an options object: an object that is neither null nor an array. */
export function isOptionsObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/** Validates `LockModule.forRoot()` options and fills in defaults. Throws `LockConfigurationError`. */
export function resolveModuleOptions(options: unknown): ResolvedModuleOptions {
  const where = 'LockModule options';
  if (options === undefined || options === null) options = {};
  if (!isOptionsObject(options)) {
    throw new LockConfigurationError('options', `${where} must be an object; got ${describe(options)}.`);
  }
  const o = options;
  rejectUnknown(o, MODULE_OPTION_NAMES, where);
  const redlock = redlockOption(o.redlock, where);
  if (redlock && o.redis !== undefined) {
    throw new LockConfigurationError('redlock', `${where}: give either redis (one server, Sentinel or Cluster) or redlock (independent masters), not both.`);
  }
  if (redlock && o.store === 'memory') {
    throw new LockConfigurationError('redlock', `${where}: store 'memory' keeps locks in this process; leave redlock out with it.`);
  }
  if (redlock && o.fencingCounterTtlMs !== undefined) {
    throw new LockConfigurationError(
      'fencingCounterTtlMs',
      `${where}: redlock issues no fencing tokens, so its masters keep no fencing counters; leave fencingCounterTtlMs out.`,
    );
  }
  const fencingTokens = bool(o.fencingTokens, 'fencingTokens', where, !redlock);
  if (fencingTokens && redlock) {
    throw new LockConfigurationError(
      'fencingTokens',
      `${where}: redlock issues no fencing tokens (counters on independent masters cannot be made monotonic together); leave fencingTokens out, or use one Redis server, Sentinel or Cluster where fencing matters.`,
    );
  }
  if (!fencingTokens && !redlock && o.fencingCounterTtlMs !== undefined) {
    throw new LockConfigurationError(
      'fencingCounterTtlMs',
      `${where}: fencingTokens is false, so grants keep no fencing counters; leave fencingCounterTtlMs out (or set fencingTokens to true).`,
    );
  }
  const replication = replicationOption(o.replication, where);
  if (replication && (redlock || isClusterConnection(o.redis))) {
    throw new LockConfigurationError(
      'replication',
      `${where}: replication (WAIT) works on one server or a Sentinel-managed master only; ${redlock ? 'Redlock already needs a majority of masters' : 'on Redis Cluster WAIT cannot follow a lock to its master'}. Leave replication out.`,
    );
  }
  return {
    store: storeOption(o.store, where),
    redis: redisOption(o.redis),
    keyPrefix: keyPrefixOption(o.keyPrefix),
    leaseMs: duration(o.leaseMs, 'leaseMs', where, { min: MIN_LEASE_MS, fallback: 30_000 }),
    watchdog: bool(o.watchdog, 'watchdog', where, true),
    waitMs: duration(o.waitMs, 'waitMs', where, { min: 0, fallback: 10_000, infinity: true }),
    connectTimeoutMs: duration(o.connectTimeoutMs, 'connectTimeoutMs', where, { min: 0, fallback: 10_000 }),
    stepTimeoutMs: duration(o.stepTimeoutMs, 'stepTimeoutMs', where, { min: MIN_STEP_TIMEOUT_MS, fallback: DEFAULT_STEP_TIMEOUT_MS }),
    onContention: contentionOption(o.onContention, where, 'wait'),
    minHoldMs: duration(o.minHoldMs, 'minHoldMs', where, { min: 0, fallback: 0 }),
    contendedHttpStatus: httpStatusOption(o.contendedHttpStatus, where),
    fairQueueTimeoutMs: duration(o.fairQueueTimeoutMs, 'fairQueueTimeoutMs', where, { min: MIN_LEASE_MS, fallback: DEFAULT_FAIR_QUEUE_TIMEOUT_MS }),
    fencingCounterTtlMs: duration(o.fencingCounterTtlMs, 'fencingCounterTtlMs', where, { min: MIN_FENCING_COUNTER_TTL_MS, fallback: FENCE_COUNTER_TTL_MS }),
    fencingTokens,
    replication,
    redlock,
  };
}

/**
 * An ioredis Cluster client, or `{ cluster, options }`. Not `'cluster' in value` for clients: every
 * ioredis client has a `cluster()` method (the CLUSTER command); only a Cluster client says `isCluster`.
 */
function isClusterConnection(value: unknown): boolean {
  const v = value as Record<string, unknown> | null | undefined;
  if (typeof v !== 'object' || v === null) return false;
  return isRedisClient(v) ? v.isCluster === true : 'cluster' in v;
}

function replicationOption(value: unknown, where: string): Required<ReplicationOptions> | undefined {
  if (value === undefined) return undefined;
  const name = 'replication';
  if (!isOptionsObject(value)) {
    throw new LockConfigurationError(name, `${where}: replication must be an object like { replicas: 1, timeoutMs: 100 }; got ${describe(value)}.`);
  }
  const o = value;
  rejectUnknown(o, ['replicas', 'timeoutMs', 'onUnconfirmedAcquire'], `${where}: replication`);
  if (typeof o.replicas !== 'number' || !Number.isInteger(o.replicas) || o.replicas < 1 || o.replicas > 100) {
    throw new LockConfigurationError('replication.replicas', `${where}: replication.replicas must be a whole number of replicas from 1 to 100; got ${describe(o.replicas)}.`);
  }
  const onUnconfirmedAcquire = o.onUnconfirmedAcquire ?? 'rollback';
  if (onUnconfirmedAcquire !== 'rollback' && onUnconfirmedAcquire !== 'keep') {
    throw new LockConfigurationError('replication.onUnconfirmedAcquire', `${where}: replication.onUnconfirmedAcquire must be 'rollback' or 'keep'; got ${describe(o.onUnconfirmedAcquire)}.`);
  }
  return {
    replicas: o.replicas,
    timeoutMs: duration(o.timeoutMs, 'replication.timeoutMs', where, { min: 1, fallback: 100 }),
    onUnconfirmedAcquire,
  };
}

function redlockOption(value: unknown, where: string): Required<RedlockOptions> | undefined {
  if (value === undefined) return undefined;
  if (!isOptionsObject(value)) {
    throw new LockConfigurationError('redlock', `${where}: redlock must be an object like { clients: [url1, url2, url3] }; got ${describe(value)}.`);
  }
  const o = value;
  rejectUnknown(o, ['clients', 'driftFactor'], `${where}: redlock`);
  if (!Array.isArray(o.clients) || o.clients.length < 3 || o.clients.length % 2 === 0) {
    throw new LockConfigurationError(
      'redlock.clients',
      `${where}: redlock.clients must list an odd number of at least 3 independent Redis masters (3 or 5 is usual); got ${Array.isArray(o.clients) ? `${o.clients.length}` : describe(o.clients)}.`,
    );
  }
  const clients = o.clients.map((c) => {
    if (isClusterConnection(c)) {
      throw new LockConfigurationError('redlock.clients', `${where}: redlock.clients are independent masters; a Redis Cluster cannot be one of them.`);
    }
    const client = redisOption(c);
    if (typeof client === 'object' && !isRedisClient(client) && Array.isArray((client as RedisOptions).sentinels)) {
      throw new LockConfigurationError('redlock.clients', `${where}: redlock.clients are independent masters; do not give Sentinel options (a failover would break the quorum's assumptions).`);
    }
    return client as string | RedisOptions | Redis;
  });
  const driftFactor = o.driftFactor ?? 0.01;
  if (typeof driftFactor !== 'number' || !Number.isFinite(driftFactor) || driftFactor < 0 || driftFactor >= 0.5) {
    throw new LockConfigurationError('redlock.driftFactor', `${where}: redlock.driftFactor must be a number from 0 to below 0.5 (a share of the lease); got ${describe(o.driftFactor)}.`);
  }
  return { clients, driftFactor };
}

/**
 * Checks `@Locked` options when the class is defined (before any module exists): types, ranges,
 * unknown names. The module's defaults are applied later, per LockService.
 */
export function validateLockedOptions(options: unknown, where: string): LockedOptions {
  if (options === undefined) return {};
  if (!isOptionsObject(options)) {
    throw new LockConfigurationError('options', `${where}: options must be an object; got ${describe(options)}.`);
  }
  const o = options;
  rejectUnknown(o, LOCKED_OPTION_NAMES, where);
  const waitMs = duration(o.waitMs, 'waitMs', where, { min: 0, fallback: 0, infinity: true });
  duration(o.leaseMs, 'leaseMs', where, { min: MIN_LEASE_MS, fallback: 0 });
  bool(o.watchdog, 'watchdog', where, true);
  const policy = contentionOption(o.onContention, where, 'wait');
  if (waitMs > 0 && policy !== 'wait') {
    // It would be ignored: 'fail' and 'skip' try the lock once (as tryAcquire(), which refuses waitMs too).
    throw new LockConfigurationError(
      'waitMs',
      `${where}: onContention '${policy}' tries the lock once and never waits; leave waitMs out, or use onContention 'wait' to wait up to ${waitMs} ms.`,
    );
  }
  const minHoldMs = duration(o.minHoldMs, 'minHoldMs', where, { min: 0, fallback: 0 });
  const mode = modeOption(o.mode, where);
  exclusiveIfFair(bool(o.fair, 'fair', where, false), mode, where);
  if (minHoldMs > 0 && mode === 'read') {
    throw new LockConfigurationError(
      'minHoldMs',
      `${where}: minHoldMs keeps an exclusive or write lock after the call; a read lock is shared, and Redis keeps one lease for all its readers, so a read hold kept after the call would last as long as the other readers keep the lock. Leave minHoldMs out, or use mode 'write'.`,
    );
  }
  return o as LockedOptions;
}

/** Several keys are taken as exclusive locks only: `fair` and a read-write `mode` are refused for a group. */
export function exclusiveGroup(fair: boolean | undefined, mode: LockMode | undefined, where: string): void {
  if (fair || (mode !== undefined && mode !== 'exclusive')) {
    throw new LockConfigurationError('keys', `${where}: multi-key locks are exclusive; fair and mode apply to one key at a time.`);
  }
}

/** Fair mode queues exclusive locks only: refused with a read-write `mode`, when the options are checked. */
function exclusiveIfFair(fair: boolean, mode: LockMode, where: string): void {
  if (fair && mode !== 'exclusive') {
    throw new LockConfigurationError('fair', `${where}: fair mode is for exclusive locks; read-write locks already keep writers from starving.`);
  }
}

function storeOption(value: unknown, where: string): 'redis' | 'memory' {
  if (value === undefined) return 'redis';
  if (value === 'redis' || value === 'memory') return value;
  throw new LockConfigurationError('store', `${where}: store must be 'redis' or 'memory'; got ${describe(value)}.`);
}

function modeOption(value: unknown, where: string): LockMode {
  if (value === undefined) return 'exclusive';
  if (value === 'read' || value === 'write') return value;
  throw new LockConfigurationError('mode', `${where}: mode must be 'read' or 'write' (or left out for an exclusive lock); got ${describe(value)}.`);
}

function contentionOption(value: unknown, where: string, fallback: ContentionPolicy): ContentionPolicy {
  if (value === undefined) return fallback;
  if (CONTENTION_POLICIES.includes(value as ContentionPolicy)) return value as ContentionPolicy;
  throw new LockConfigurationError(
    'onContention',
    `${where}: onContention must be 'wait', 'fail' or 'skip'; got ${describe(value)}.`,
  );
}

function httpStatusOption(value: unknown, where: string): 409 | 423 {
  if (value === undefined) return 409;
  if (value === 409 || value === 423) return value;
  throw new LockConfigurationError(
    'contendedHttpStatus',
    `${where}: contendedHttpStatus must be 409 (Conflict) or 423 (Locked); got ${describe(value)}.`,
  );
}

/**
 * The options of `readLock()` / `writeLock()` with `mode` set to their side. Anything but an object
 * is returned as it is, for resolveLockOptions to refuse (spread, an array or a string would lose
 * what makes it wrong); a `mode` of another side is refused here, not overridden.
 */
export function sided(options: unknown, mode: 'read' | 'write', where: string): unknown {
  if (options === undefined) return { mode };
  if (!isOptionsObject(options)) return options;
  const given = options.mode;
  if (given !== undefined && given !== mode) {
    throw new LockConfigurationError(
      'mode',
      `${where} takes the ${mode} side of the lock; got mode ${describe(given)}. Leave mode out, or call acquire(key, { mode }).`,
    );
  }
  return { ...options, mode };
}

/** Validates one call's options against the module's defaults. Throws `LockConfigurationError`. */
export function resolveLockOptions(
  options: LockOptions | undefined,
  defaults: ResolvedModuleOptions,
  where: string,
): ResolvedLockOptions {
  if (options === undefined) {
    return { waitMs: defaults.waitMs, leaseMs: defaults.leaseMs, watchdog: defaults.watchdog, owner: undefined, signal: undefined, fair: false, mode: 'exclusive' };
  }
  const o = callOptions(options, where);
  rejectUnknown(o, LOCK_OPTION_NAMES, where);
  const fixedLease = o.leaseMs !== undefined;
  const resolved: ResolvedLockOptions = {
    waitMs: duration(o.waitMs, 'waitMs', where, { min: 0, fallback: defaults.waitMs, infinity: true }),
    leaseMs: duration(o.leaseMs, 'leaseMs', where, { min: MIN_LEASE_MS, fallback: defaults.leaseMs }),
    watchdog: bool(o.watchdog, 'watchdog', where, fixedLease ? false : defaults.watchdog),
    owner: ownerOption(o.owner, where),
    signal: signalOption(o.signal, where),
    fair: bool(o.fair, 'fair', where, false),
    mode: modeOption(o.mode, where),
  };
  exclusiveIfFair(resolved.fair, resolved.mode, where);
  return resolved;
}

/**
 * The options of `holdCount()`: whose holds (`owner`) on which side (`mode`). Options that only
 * shape an acquisition (`waitMs`, `leaseMs`, ...) are refused rather than ignored.
 */
export function resolveHoldCountOptions(options: unknown, where: string): { owner: string | undefined; mode: LockMode } {
  if (options === undefined) return { owner: undefined, mode: 'exclusive' };
  const o = callOptions(options, where);
  rejectUnknown(o, HOLD_COUNT_OPTION_NAMES, where);
  return { owner: ownerOption(o.owner, where), mode: modeOption(o.mode, where) };
}

/** A call's options object; anything else (null, an array, a string) is refused naming the call. */
function callOptions(options: unknown, where: string): Record<string, unknown> {
  if (!isOptionsObject(options)) {
    throw new LockConfigurationError('options', `${where} options must be an object; got ${describe(options)}.`);
  }
  return options;
}

function redisOption(value: unknown): RedisConnection {
  if (value === undefined) return 'redis://127.0.0.1:6379';
  if (typeof value === 'string') {
    if (/^rediss?:\/\//i.test(value)) {
      // A URL's scheme is case-insensitive, but ioredis takes only a lower-case "rediss://" as TLS:
      // "REDISS://host" would connect in plain text, password included.
      refuseBadUrl(value);
      return value.replace(/^rediss?:/i, (scheme) => scheme.toLowerCase());
    }
    throw new LockConfigurationError(
      'redis',
      `redis must be a redis:// or rediss:// URL, ioredis options, or an ioredis client; got the string "${redactUrls(value)}".${urlHint(value)}`,
    );
  }
  if (typeof value === 'object' && value !== null && !Array.isArray(value)) {
    const v = value as Record<string, unknown>;
    if (isRedisClient(v)) {
      if (v.isCluster === true) {
        const nodes = (value as Cluster).options?.redisOptions;
        return resendsUnanswered(value as Cluster, nodes?.autoResendUnfulfilledCommands, 'an ioredis Cluster client whose redisOptions have');
      }
      return resendsUnanswered(value as Redis, (value as Redis).options?.autoResendUnfulfilledCommands, 'an ioredis client with');
    }
    if ('cluster' in v) {
      if (!Array.isArray(v.cluster) || v.cluster.length === 0) {
        throw new LockConfigurationError('redis', `redis.cluster must be a non-empty array of startup nodes ({ host, port } or "host:port"); got ${describeRedacted(v.cluster)}.`);
      }
      for (const node of v.cluster) {
        if (typeof node === 'object' && node !== null) refuseBadEndpoint(node as Record<string, unknown>, 'a redis.cluster startup node');
        else if (typeof node === 'string') refuseBadClusterNode(node);
      }
      const extra = Object.keys(v).filter((k) => k !== 'cluster' && k !== 'options');
      if (extra.length > 0) {
        throw new LockConfigurationError('redis', `redis: { cluster, options } takes no other fields; move ${extra.join(', ')} into options (ioredis ClusterOptions).`);
      }
      const nodes = (v.options as ClusterOptions | undefined)?.redisOptions;
      return resendsUnanswered(value as RedisClusterConnection, nodes?.autoResendUnfulfilledCommands, 'redis.cluster options whose redisOptions have');
    }
    if (typeof v.evalSha === 'function' || typeof v.isOpen === 'boolean') {
      throw new LockConfigurationError(
        'redis',
        'redis looks like a node-redis client; nestjs-locked needs an ioredis client (`new Redis(url)` from the ioredis package), a URL, or ioredis options.',
      );
    }
    if (typeof v.then === 'function' || typeof v.on === 'function' || typeof v.constructor === 'function' && v.constructor !== Object) {
      throw new LockConfigurationError(
        'redis',
        `redis is an object of class ${(v.constructor as { name?: string })?.name ?? 'unknown'} that is not an ioredis client; pass an ioredis client, a redis:// URL, or plain ioredis options.`,
      );
    }
    refuseForeignOptions(v);
    if (v.sentinels !== undefined && v.sentinels !== null) refuseBadSentinels(v);
    else if (v.path === undefined) refuseBadEndpoint(v, 'redis');
    return resendsUnanswered(value as RedisOptions, v.autoResendUnfulfilledCommands, 'ioredis options with');
  }
  throw new LockConfigurationError(
    'redis',
    `redis must be a redis:// URL, ioredis options, or an ioredis client; got ${describe(value)}.`,
  );
}

/**
 * Refuses a redis:// URL that ioredis 6 throws on (Node's "Invalid URL", with the URL, password
 * included, in the error's input) and ioredis 5.9 reads differently: a password with a `#`, `/` or
 * `?` that is not percent-encoded cuts the URL short, and ioredis 5.9 connected to localhost:6379.
 * And one that names no host (`redis://`, an empty variable in `redis://${host}`), which ioredis
 * connects to localhost:6379.
 */
function refuseBadUrl(value: string, where = 'redis: the URL'): void {
  const shown = `${where} "${redactUrls(value)}"`;
  let url: URL;
  try {
    url = new URL(value);
    decodeURIComponent(url.username);
    decodeURIComponent(url.password);
  } catch {
    throw new LockConfigurationError(
      'redis',
      `${shown} does not parse. Percent-encode the user name and password (encodeURIComponent): a #, /, ? or % in them cuts the URL short. A port is a number from 1 to 65535.`,
    );
  }
  if (url.hostname === '') {
    throw new LockConfigurationError(
      'redis',
      `${shown} names no host, and ioredis would connect to localhost:6379 (an environment variable set to nothing?). Write the host, or leave redis out for redis://127.0.0.1:6379.`,
    );
  }
  if (url.port !== '' && !isPort(url.port)) {
    throw new LockConfigurationError('redis', `${shown} has port ${url.port}; a port is a number from 1 to 65535.`);
  }
}

/**
 * A Cluster startup node given as a string: ioredis reads `host:port` as `redis://host:port`, and
 * throws on what does not parse as it throws on a URL (see refuseBadUrl).
 */
function refuseBadClusterNode(node: string): void {
  if (/^rediss?:\/\//i.test(node)) return refuseBadUrl(node, 'a redis.cluster startup node');
  if (node.includes('://')) {
    throw new LockConfigurationError('redis', `a redis.cluster startup node must be a redis:// URL, "host:port" or { host, port }; got "${redactUrls(node)}".`);
  }
  refuseBadUrl(`redis://${node}`, 'a redis.cluster startup node, read as');
}

/** What to write instead of a connection string that is not a redis:// or rediss:// URL (secrets left out). */
function urlHint(value: string): string {
  const socket = /^(?:unix:\/\/)?(\/.*)$/i.exec(value)?.[1];
  if (socket) return ` For a Unix socket give ioredis options: { path: ${JSON.stringify(redactUrls(socket))} }.`;
  const valkey = /^valkey(s?):\/\//i.exec(value);
  if (valkey) {
    const url = `redis${valkey[1].toLowerCase()}://${value.slice(valkey[0].length)}`;
    return ` Valkey speaks the Redis protocol and ioredis knows only the redis schemes: write "${redactUrls(url)}".`;
  }
  if (/^[^:/\s]+:\d+(?:\/\d*)?$/.test(value)) return ` Add the scheme: "redis://${value}".`;
  return '';
}

/**
 * Refuses a host and port no connection can be made with, as environment variables read without a
 * check give them: `Number(process.env.REDIS_PORT)` of an unset variable is NaN, and Node then
 * refuses the connection, which ioredis tries again until the connectTimeoutMs deadline; an empty
 * `REDIS_HOST` makes an empty host, which Node takes for localhost.
 */
function refuseBadEndpoint(o: Record<string, unknown>, where: string): void {
  const { host, port } = o;
  if (port !== undefined && !isPort(port)) {
    throw new LockConfigurationError(
      'redis',
      `${where}: port must be a whole number from 1 to 65535 (a string of digits is read as one); got ${describe(port)}. ` +
        'Number() of an environment variable that is not set gives NaN; leave port out for 6379.',
    );
  }
  if (host !== undefined && (typeof host !== 'string' || host.trim() === '')) {
    throw new LockConfigurationError(
      'redis',
      `${where}: host must be a host name or an address; got ${describe(host)}.` +
        (typeof host === 'string' ? ' ioredis would connect to localhost instead (an environment variable set to nothing?); leave host out for localhost.' : ''),
    );
  }
}

/**
 * Refuses Sentinel options that ioredis throws on when nestjs-locked creates the client at bootstrap
 * (no `name`, no sentinels: a plain `Error`), or reads as something else: a list in one string, as
 * an environment variable holds it, or an entry that is not `{ host, port }`.
 */
function refuseBadSentinels(v: Record<string, unknown>): void {
  const { sentinels, name } = v;
  if (!Array.isArray(sentinels) || sentinels.length === 0 || sentinels.some((s) => typeof s !== 'object' || s === null || Array.isArray(s))) {
    throw new LockConfigurationError(
      'redis',
      `redis.sentinels must be a non-empty array of { host, port } objects; got ${Array.isArray(sentinels) ? (sentinels.length === 0 ? 'an empty array' : 'an array with an entry that is not an object') : describeRedacted(sentinels)}. ` +
        'Split a list such as "host1:26379,host2:26379" into [{ host: "host1", port: 26379 }, { host: "host2", port: 26379 }].',
    );
  }
  for (const node of sentinels) refuseBadEndpoint(node as Record<string, unknown>, 'a redis.sentinels entry');
  if (typeof name !== 'string' || name === '') {
    throw new LockConfigurationError('redis', `redis: with sentinels, name must be the name of the master the sentinels monitor (mymaster in sentinel.conf, say); got ${describe(name)}.`);
  }
  if (v.role !== undefined && v.role !== 'master') {
    throw new LockConfigurationError('redis', `redis: with sentinels, role must be 'master' (or left out); got ${describe(v.role)}. ioredis would connect to a replica, which refuses the writes every lock step makes.`);
  }
}

function isPort(port: unknown): boolean {
  const n = typeof port === 'string' && /^\d{1,5}$/.test(port) ? Number(port) : port;
  return typeof n === 'number' && Number.isInteger(n) && n >= 1 && n <= 65_535;
}

/**
 * Refuses options that ioredis would ignore and then connect to localhost, whatever Redis
 * listens there: `url` and `socket` are node-redis's (`createClient({ url })`), `hostname` is a URL
 * object's name for `host`, and a URL given as `host` would be looked up as a host name.
 */
function refuseForeignOptions(v: Record<string, unknown>): void {
  const foreign = ['url', 'socket'].find((name) => v[name] !== undefined);
  if (foreign) {
    throw new LockConfigurationError(
      'redis',
      `redis: ioredis options have no "${foreign}" (that is node-redis's createClient() option), and ioredis would connect to localhost:6379 instead. ` +
        `Give the URL itself (redis: 'redis://host:6379'), or ioredis options such as { host, port, password }.`,
    );
  }
  if (v.hostname !== undefined && v.host === undefined) {
    throw new LockConfigurationError(
      'redis',
      `redis: ioredis options have no "hostname" (ioredis calls it host), and ioredis would connect to localhost instead (on the port given). Write { host: ${describe(v.hostname)} }.`,
    );
  }
  if (typeof v.host === 'string' && v.host.includes('://')) {
    throw new LockConfigurationError(
      'redis',
      `redis: host must be a host name, not a URL; got ${describeRedacted(v.host)}. Give the URL itself as redis (redis: ${describeRedacted(v.host)}), or its host and port as { host, port }.`,
    );
  }
}

/**
 * Refuses a connection with ioredis's `autoResendUnfulfilledCommands` off: ioredis then drops the
 * commands in flight on a connection that closed, without ever settling their promises, so a
 * release could wait for ever. On (the default), ioredis sends them again, and the store corrects a
 * lock step Redis ran twice (see RedisLockStore's `resent`). On a Cluster the option sits in
 * `redisOptions`, the options of each node's connection: a node connection that reconnects (ioredis
 * 6's `clusterNodeRetryStrategy`) drops its commands in flight the same way.
 */
function resendsUnanswered<T>(connection: T, resend: unknown, what: string): T {
  if (resend !== false) return connection;
  throw new LockConfigurationError(
    'redis',
    `redis: ${what} autoResendUnfulfilledCommands: false. ioredis then drops the commands in flight when a connection closes ` +
      'and never settles them, so a lock release could wait for ever. Leave autoResendUnfulfilledCommands out (on is the ioredis default): ' +
      'nestjs-locked corrects a lock step that ioredis sent again.',
  );
}

/** Duck-typed so a second copy of ioredis (or ioredis 5 next to 6) is still recognised. */
export function isRedisClient(value: unknown): value is Redis {
  const v = value as Record<string, unknown> | null;
  return (
    typeof v === 'object' &&
    v !== null &&
    typeof v.evalsha === 'function' &&
    typeof v.duplicate === 'function' &&
    typeof v.status === 'string'
  );
}

function keyPrefixOption(value: unknown): string {
  if (value === undefined) return 'lock:';
  if (typeof value !== 'string') {
    throw new LockConfigurationError('keyPrefix', `keyPrefix must be a string; got ${describe(value)}.`);
  }
  if (value.length > MAX_PREFIX_LENGTH || /[{}]/.test(value)) {
    throw new LockConfigurationError(
      'keyPrefix',
      `keyPrefix must be at most ${MAX_PREFIX_LENGTH} characters without "{" or "}" (nestjs-locked adds its own Cluster hash tag); got "${value}".`,
    );
  }
  return value;
}

function ownerOption(value: unknown, where: string): string | undefined {
  if (value === undefined) return undefined;
  // Redis keeps an owner's read holds in hash field `owner:read`, and fields starting with ":" for
  // the lock itself: an owner "job:read" would share its field with owner "job"'s read holds.
  if (typeof value !== 'string' || value.length === 0 || value.length > MAX_OWNER_LENGTH || value.startsWith(':') || value.endsWith(':read')) {
    throw new LockConfigurationError(
      'owner',
      `${where}: owner must be a non-empty string of at most ${MAX_OWNER_LENGTH} characters, not starting with ":" nor ending with ":read" (both reserved for nestjs-locked's own hash fields); got ${describe(value)}.`,
    );
  }
  return value;
}

function signalOption(value: unknown, where: string): AbortSignal | undefined {
  if (value === undefined) return undefined;
  if (value instanceof AbortSignal) return value;
  throw new LockConfigurationError('signal', `${where}: signal must be an AbortSignal; got ${describe(value)}.`);
}

/** A boolean option: `fallback` when left out; anything else than true or false is refused. */
export function bool(value: unknown, name: string, where: string, fallback: boolean): boolean {
  if (value === undefined) return fallback;
  if (typeof value === 'boolean') return value;
  throw new LockConfigurationError(name, `${where}: ${name} must be true or false; got ${describe(value)}.`);
}

/**
 * A duration in whole milliseconds within [min, MAX_DURATION_MS]; `Infinity` only where it means
 * "for ever".
 */
export function duration(
  value: unknown,
  name: string,
  where: string,
  rule: { min: number; fallback: number; infinity?: boolean },
): number {
  if (value === undefined) return rule.fallback;
  if (rule.infinity && value === Infinity) return Infinity;
  if (typeof value !== 'number' || !Number.isInteger(value) || value < rule.min || value > MAX_DURATION_MS) {
    throw new LockConfigurationError(
      name,
      `${where}: ${name} must be a whole number of milliseconds from ${rule.min} to ${MAX_DURATION_MS}` +
        `${rule.infinity ? ' (or Infinity to wait for ever)' : ''}; got ${describe(value)}.`,
    );
  }
  return value;
}

function rejectUnknown(o: Record<string, unknown>, known: readonly string[], where: string): void {
  for (const name of Object.keys(o)) {
    if (known.includes(name)) continue;
    const near = known.find((k) => closeTo(k, name));
    throw new LockConfigurationError(
      name,
      `${where}: unknown option "${name}"${near ? ` (did you mean "${near}"?)` : ''}. Known options: ${known.join(', ')}.`,
    );
  }
}

/** Same letters ignoring case, or one edit apart: catches `leaseMS`, `waitms`, `keyprefix`, `leasMs`. */
function closeTo(a: string, b: string): boolean {
  const x = a.toLowerCase();
  const y = b.toLowerCase();
  if (x === y) return true;
  if (Math.abs(x.length - y.length) > 1) return false;
  let i = 0;
  while (i < x.length && i < y.length && x[i] === y[i]) i++;
  return x.slice(i + 1) === y.slice(i + 1) || x.slice(i) === y.slice(i + 1) || x.slice(i + 1) === y.slice(i);
}

/** describe() of a value that may be a connection string: its secrets hidden before it is shortened. */
function describeRedacted(value: unknown): string {
  return describe(typeof value === 'string' ? redactUrls(value) : value);
}

/** A short, safe description of a bad value for an error message. */
export function describe(value: unknown): string {
  if (value === null) return 'null';
  if (typeof value === 'string') return JSON.stringify(value.length > 80 ? value.slice(0, 80) + '…' : value);
  if (typeof value === 'number' || typeof value === 'boolean' || typeof value === 'bigint') return String(value);
  if (typeof value === 'undefined') return 'undefined';
  if (typeof value === 'function') return 'a function';
  if (Array.isArray(value)) return 'an array';
  return `an object (${(value as object).constructor?.name ?? 'no prototype'})`;
}
