import { afterAll, beforeAll, expect } from '@jest/globals';
import { Module, type INestApplication, type INestApplicationContext, type LoggerService, type ModuleMetadata, type Provider } from '@nestjs/common';
import { NestFactory } from '@nestjs/core';
import { Test, type TestingModule } from '@nestjs/testing';
import { filter, firstValueFrom, take, timeout, toArray, type Observable } from 'rxjs';
import { LockModule, LockService, type LockEvent, type LockModuleOptions } from '../../lib/index.js';
import { AsyncResource, createHook } from 'node:async_hooks';
import { getEventListeners, type EventEmitter } from 'node:events';
import { performance } from 'node:perf_hooks';
import { clearTimeout as realClearTimeout, setTimeout as realSetTimeout } from 'node:timers';
import type { Redis } from 'ioredis';
import { RedisServer, until } from './redis-server.js';

/** Collects what the library logs, so tests can assert on levels and messages. */
export class CapturingLogger implements LoggerService {
  readonly entries: { level: string; message: string; context?: string }[] = [];
  log(message: unknown, context?: string) {
    this.entries.push({ level: 'log', message: String(message), context });
  }
  error(message: unknown, _trace?: string, context?: string) {
    this.entries.push({ level: 'error', message: String(message), context });
  }
  warn(message: unknown, context?: string) {
    this.entries.push({ level: 'warn', message: String(message), context });
  }
  debug(message: unknown, context?: string) {
    this.entries.push({ level: 'debug', message: String(message), context });
  }
  verbose(message: unknown, context?: string) {
    this.entries.push({ level: 'verbose', message: String(message), context });
  }
  at(level: string): string[] {
    return this.entries.filter((e) => e.level === level).map((e) => e.message);
  }
}

/** Starts `app` on a free loopback port; resolves to its base URL (127.0.0.1, never [::1]). */
export async function listening(app: INestApplication): Promise<string> {
  await app.listen(0, '127.0.0.1');
  return (await app.getUrl()).replace('[::1]', '127.0.0.1');
}

/** Whether LockService logged, at error level, that `key` could not be had because Redis did not answer. */
export function loggedUnavailable(logger: CapturingLogger, key: string): boolean {
  return logger.entries.some((e) => e.level === 'error' && e.context === 'LockService' && e.message.includes(`"${key}"`) && e.message.includes('no answer within'));
}

export interface LockApp {
  moduleRef: TestingModule;
  locks: LockService;
  logger: CapturingLogger;
  close(): Promise<void>;
}

/** A Nest testing module with `LockModule.forRoot(options)` and `providers`, initialised (bootstrap checks run). */
export async function startLockApp(options: LockModuleOptions, providers: Provider[] = []): Promise<LockApp> {
  const logger = new CapturingLogger();
  const moduleRef = await Test.createTestingModule({ imports: [LockModule.forRoot(options)], providers })
    .setLogger(logger)
    .compile();
  await moduleRef.init();
  return { moduleRef, locks: moduleRef.get(LockService), logger, close: () => moduleRef.close() };
}

/**
 * One instance of an application, as a deployment runs several: a Nest application context with
 * `LockModule.forRoot({ redis: redisUrl, isGlobal: true })`, the other `imports` and the
 * `providers`, initialised (so its schedulers, listeners, workers and handlers are registered).
 */
export async function startInstance(
  redisUrl: string,
  { imports = [], providers = [] }: Pick<ModuleMetadata, 'imports' | 'providers'>,
  logger: LoggerService = new CapturingLogger(),
): Promise<INestApplicationContext> {
  @Module({ imports: [LockModule.forRoot({ redis: redisUrl, isGlobal: true }), ...imports], providers })
  class InstanceModule {}
  const app = await NestFactory.createApplicationContext(InstanceModule, { logger });
  await app.init();
  return app;
}

/** What `usePrivateLockApp` starts for a describe block. */
export interface PrivateLockApp {
  redis: RedisServer;
  /** A client of the test's own, for inspecting Redis (closed with the server). */
  raw: Redis;
  app: LockApp;
  /** A second app on the same server (another process, as far as locks can tell); undefined unless `other` options were given. */
  other: LockApp;
}

/**
 * Registers the hooks most suites share: before all tests, a private redis-server, a client of the
 * test's own on it and `startLockApp({ redis: <its url>, ...options })` (and a second app with
 * `other`, if given), handed to `assign` (for the suite's own variables); after all tests, the apps
 * closed, then the server stopped. Jest runs beforeAll and afterAll hooks in the order they are
 * declared, so a suite's hooks declared after this one run once the server is up, and once it is
 * stopped: a suite that has more to close on this server before it stops keeps hooks of its own.
 */
export function usePrivateLockApp(
  options: Omit<LockModuleOptions, 'redis'>,
  assign: (started: PrivateLockApp) => void,
  other?: Omit<LockModuleOptions, 'redis'>,
): void {
  let redis: RedisServer | undefined;
  const apps: LockApp[] = [];
  const start = async (server: RedisServer, o: Omit<LockModuleOptions, 'redis'>) => {
    const app = await startLockApp({ redis: server.url, ...o } as LockModuleOptions);
    apps.push(app);
    return app;
  };
  beforeAll(async () => {
    redis = await RedisServer.start();
    const raw = redis.client();
    const app = await start(redis, options);
    const second = other ? await start(redis, other) : (undefined as unknown as LockApp);
    assign({ redis, raw, app, other: second });
  });
  afterAll(async () => {
    for (const app of apps.splice(0)) await app.close();
    await redis?.stop();
  });
}

/**
 * Takes and releases a lock once in each way but fair mode: plain and re-entered (`<prefix>:plain`),
 * read then write (`<prefix>:rw`), and a multi-key group (`<prefix>:a`, `<prefix>:b`). Resolves to
 * those keys, for checking what the releases left in Redis.
 */
export async function lockEachWay(locks: LockService, prefix: string): Promise<string[]> {
  await locks.run(`${prefix}:plain`, () => locks.run(`${prefix}:plain`, () => undefined));
  await (await locks.acquire(`${prefix}:rw`, { mode: 'read' })).release();
  await (await locks.acquire(`${prefix}:rw`, { mode: 'write' })).release();
  await (await locks.acquire([`${prefix}:a`, `${prefix}:b`])).release();
  return [`${prefix}:plain`, `${prefix}:rw`, `${prefix}:a`, `${prefix}:b`];
}

type EventOf<T extends LockEvent['type']> = Extract<LockEvent, { type: T }>;

/** The next event of `type` (matching `where`), failing after `ms`. Subscribe before causing it. */
export function nextEvent<T extends LockEvent['type']>(
  events$: Observable<LockEvent>,
  type: T,
  where: (e: EventOf<T>) => boolean = () => true,
  ms = 10_000,
): Promise<EventOf<T>> {
  return firstValueFrom(
    events$.pipe(
      filter((e): e is EventOf<T> => e.type === type && where(e as EventOf<T>)),
      timeout({ first: ms, with: () => { throw new Error(`no "${type}" event within ${ms} ms`); } }),
    ),
  );
}

/** The next `count` events of `type`. */
export function nextEvents<T extends LockEvent['type']>(events$: Observable<LockEvent>, type: T, count: number, ms = 10_000): Promise<EventOf<T>[]> {
  return firstValueFrom(
    events$.pipe(
      filter((e): e is EventOf<T> => e.type === type),
      take(count),
      toArray(),
      timeout({ first: ms, with: () => { throw new Error(`fewer than ${count} "${type}" events within ${ms} ms`); } }),
    ),
  );
}

/** Resolves when `signal` aborts, with its reason. */
export function aborted(signal: AbortSignal): Promise<unknown> {
  if (signal.aborted) return Promise.resolve(signal.reason);
  return new Promise((resolve) => signal.addEventListener('abort', () => resolve(signal.reason), { once: true }));
}

/**
 * What other signals have hooked onto `signal`: its `abort` listeners, and the entries
 * `AbortSignal.any` leaves on it (Node 20 never removes those).
 */
export function signalHooks(signal: AbortSignal): { dependants: number; listeners: number } {
  const symbol = Object.getOwnPropertySymbols(signal).find((s) => s.description === 'kDependantSignals');
  const dependants = symbol === undefined ? undefined : (signal as unknown as Record<symbol, Set<unknown> | undefined>)[symbol];
  return { dependants: dependants?.size ?? 0, listeners: getEventListeners(signal, 'abort').length };
}

/**
 * The delays (ms) of the timers `fn` armed that are still pending when it returns (neither fired
 * nor cleared) and keep the process alive (not unref'd): what would hold a process up after it.
 */
export async function timersLeftBy(fn: () => Promise<unknown>): Promise<number[]> {
  const pending = new Map<number, { _idleTimeout: number; hasRef(): boolean }>();
  const hook = createHook({
    init(id, type, _trigger, resource) {
      if (type === 'Timeout') pending.set(id, resource as { _idleTimeout: number; hasRef(): boolean });
    },
    destroy(id) {
      pending.delete(id);
    },
  }).enable();
  try {
    await fn();
  } finally {
    hook.disable();
  }
  return [...pending.values()].filter((timer) => timer.hasRef()).map((timer) => timer._idleTimeout);
}

/** Runs `fn` outside the caller's lock context (a fresh async scope): its locks get their own owner. */
export function elsewhere<T>(fn: () => Promise<T>): Promise<T> {
  return new AsyncResource('elsewhere').runInAsyncScope(fn);
}

/**
 * Whether the work journalled in `entries` ran one at a time: each entry line (ending in `enter`) is
 * followed at once by its own exit (the same line with `exit` in place of `enter`). Pass
 * `' enter x1'` to require each entry's hold count to be 1 as well (a re-entry is not its own turn).
 */
export function oneAtATime(entries: string[], enter = ' enter'): boolean {
  for (let i = 0; i < entries.length; i += 2) {
    const [entry, exit] = [entries[i]!, entries[i + 1]];
    if (!entry.endsWith(enter) || exit !== `${entry.slice(0, -enter.length)} exit`) return false;
  }
  return entries.length % 2 === 0;
}

/** A promise with its resolve function outside, for hand-made synchronisation points. */
export function gate<T = void>(): { promise: Promise<T>; open: (value: T) => void } {
  let open!: (value: T) => void;
  const promise = new Promise<T>((resolve) => (open = resolve));
  return { promise, open };
}

/**
 * Resolves once the fair waiter `owner` of `key` has registered its wait id in Redis (its attempt
 * after subscribing to the release channel): from then on it sleeps, and a handover message can
 * reach it. `redis` is any client of the server that holds the lock (default prefix `lock:`).
 */
export async function waitRegistered(redis: { hget(key: string, field: string): Promise<string | null> }, key: string, owner: string): Promise<void> {
  await until(async () => /^\d+ \S+$/.test((await redis.hget(`lock:{${key}}:queue:leases`, owner)) ?? ''), 10_000, `the fair waiter ${owner} of "${key}" never registered its wait id`);
}

/** How many waiters of `key` sleep in `app`'s store (waiting for a release; under Redlock, on any node's watch). */
export function asleep(app: LockApp, key: string): number {
  type Store = { waiters: { asleep(key: string): number } };
  const store = (app.locks as unknown as { store: Store | { nodes: { store: Store }[] } }).store;
  if ('nodes' in store) return store.nodes.reduce((sum, node) => sum + node.store.waiters.asleep(key), 0);
  return store.waiters.asleep(key);
}

/**
 * Waits out the microtasks in which a lock step just called is written and its bounds set, then
 * stalls this process for `ms` (as a long GC pause or a starved CPU would): no timer fires and no
 * socket is read meanwhile, while Redis answers.
 */
export async function stallAfterSending(ms: number): Promise<void> {
  await new Promise((resolve) => setImmediate(resolve));
  stall(ms);
}

/**
 * Stalls this process for `ms` inside a timer callback, once the steps just called are written. The
 * event loop reads its clock before it runs the timers that are due, so a timer that falls due during
 * the stall waits for the next pass, behind the socket reads of everything Redis sent meanwhile
 * (stallAfterSending stalls after the reads, so such a timer fires first).
 */
export async function stallInTimer(ms: number, then?: () => void): Promise<void> {
  await new Promise((resolve) => setImmediate(resolve));
  await new Promise<void>((resolve) =>
    setTimeout(() => {
      stall(ms);
      then?.(); // still inside the callback: before those reads
      resolve();
    }, 0),
  );
}

/** Keeps this thread busy for `ms`: no timer fires and no socket is read meanwhile. */
export function stall(ms: number): void {
  const stalled = performance.now();
  while (performance.now() - stalled < ms);
}

/**
 * `holder` (held with a 120 s lease) is freed by `free`, while `waiter` waits for `key` with a 120 s
 * wait, asleep: only the message that goes with the release (or force-unlock) can wake it within
 * `ms` (nextEvent's 10 s by default). Resolves once the waiter got the lock, and released it.
 */
export async function wokenBy(free: () => Promise<unknown>, waiter: LockApp, key: string, ms = 10_000): Promise<void> {
  const waiting = waiter.locks.acquire(key, { waitMs: 120_000 });
  await until(async () => asleep(waiter, key) === 1, 10_000, 'the waiter asleep');
  const acquired = nextEvent(waiter.locks.events$, 'acquired', (e) => e.key === key, ms);
  await free();
  await acquired;
  const lock = await waiting;
  expect(lock.holdCount).toBe(1);
  await lock.release();
}

/**
 * `times` times, on a fresh key each time (`<prefix>:<i>`): `app` holds the lock while one waiter of
 * `app` and one of `other` sleep on it, then releases it. Resolves to which waiter got the lock
 * first each time ('mine' for `app`'s, 'theirs' for `other`'s); every lock is released at the end.
 */
export async function firstAfterRelease(app: LockApp, other: LockApp, prefix: string, times: number): Promise<('mine' | 'theirs')[]> {
  const first: ('mine' | 'theirs')[] = [];
  for (let i = 0; i < times; i++) {
    const key = `${prefix}:${i}`;
    const holder = await app.locks.acquire(key);
    const mine = app.locks.acquire(key, { waitMs: 30_000 });
    const theirs = other.locks.acquire(key, { waitMs: 30_000 });
    await until(async () => asleep(app, key) === 1 && asleep(other, key) === 1, 10_000, 'both waiters asleep');
    await holder.release();
    // Whoever is granted first holds the lock until released below, so the other one waits.
    const winner = await Promise.race([mine.then(() => 'mine' as const), theirs.then(() => 'theirs' as const)]);
    first.push(winner);
    const [a, b] = winner === 'mine' ? [mine, theirs] : [theirs, mine];
    await (await a).release();
    await (await b).release();
  }
  return first;
}

/** What `settled` reads for a promise that has not settled yet. */
export const PENDING = Symbol('pending');

/**
 * `promise`'s value if it has already resolved, else PENDING, with no waiting: racing it with a
 * resolved promise lets only callbacks already due run. For a sleep that a wake settles
 * synchronously, it tells whether the wake came.
 */
export function settled<T>(promise: Promise<T>): Promise<T | typeof PENDING> {
  return Promise.race([promise, Promise.resolve(PENDING)]);
}

/**
 * What `start` fails with, for a test of a bootstrap that must fail; an Error saying "bootstrap
 * succeeded" if it does not. Whatever starts by mistake is closed first, so that a regression fails
 * the test instead of leaving a client reconnecting (and Jest waiting on it).
 */
export async function bootstrapFailure(start: () => Promise<{ close(): Promise<unknown> }>): Promise<unknown> {
  let started: { close(): Promise<unknown> };
  try {
    started = await start();
  } catch (error) {
    return error;
  }
  await started.close();
  return new Error('bootstrap succeeded');
}

/** How many listeners each event of `emitter` has (a client the application passed in, say). */
export function listenerCounts(emitter: EventEmitter): Record<string, number> {
  return Object.fromEntries(emitter.eventNames().map((name) => [String(name), emitter.listenerCount(name)]));
}

/**
 * `promise`, or a rejection after `ms`, so that a hang fails the test (and its cleanup still runs)
 * instead of timing it out. The bound is Node's own timer (`node:timers`), which a test's fake
 * timers do not replace, so it holds under them too.
 */
export async function within<T>(promise: Promise<T>, ms: number): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => (timer = realSetTimeout(() => reject(new Error(`no answer within ${ms} ms`)), ms)));
  try {
    return await Promise.race([promise, late]);
  } finally {
    realClearTimeout(timer);
  }
}
