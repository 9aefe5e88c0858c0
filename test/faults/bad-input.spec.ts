import { beforeAll, describe, expect, it } from '@jest/globals';
import { Controller, Get, Injectable, Param, type DynamicModule } from '@nestjs/common';
import { Test } from '@nestjs/testing';
import { Cluster, Redis } from 'ioredis';
import { once } from 'node:events';
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import {
  Locked,
  LockBackendError,
  LockConfigurationError,
  LockError,
  LockKeyError,
  LockLostError,
  LockModule,
  LockService,
  LockTestingModule,
  MAX_KEY_LENGTH,
  type LockHandle,
  type LockModuleOptions,
  type LockOptionsFactory,
} from '../../lib/index.js';
import { CapturingLogger, usePrivateLockApp, type LockApp } from '../support/lock-testing.js';
import { olderRedis, RedisServer, silentPort } from '../support/redis-server.js';
import { repoRoot as root } from '../support/paths.js';

/**
 * Every public entry point fed bad input. Each case must end in a typed error with a message that
 * says what to fix, or in a documented no-op; none may touch another owner's lock or leave a
 * timer or subscription behind. The table in TESTING.md is generated from these cases and checked
 * against them (UPDATE_TESTING_MD=1 rewrites it).
 */
interface Case {
  entry: string;
  input: string;
  /** An error class, or 'no-op' for a documented no-op. */
  outcome: (new (...args: never[]) => Error) | 'no-op';
  /** A fragment the message must contain (what to fix). */
  says?: RegExp;
  /** A secret given in the input that the message must not repeat (it ends up in logs). */
  hides?: string;
  run: (ctx: Ctx) => Promise<unknown>;
}
interface Ctx {
  locks: LockService;
  redis: RedisServer;
}

/**
 * Boots on a client the application closed first. Waited for ever (the connectTimeoutMs deadline
 * here) for a connection ioredis never makes again, then said "no answer".
 */
const closedClientBoot = async (redis: RedisServer) => {
  const client = new Redis(redis.url);
  await client.ping();
  const ended = once(client, 'end');
  client.disconnect();
  await ended;
  return boot({ redis: client, connectTimeoutMs: 2_000 });
};
/** The same client with connectTimeoutMs: 0 (no check at bootstrap): the first lock step says what ioredis said, once. */
const closedClientAcquire = async (redis: RedisServer) => {
  const client = new Redis(redis.url);
  const ended = once(client, 'end');
  client.disconnect();
  await ended;
  const moduleRef = await Test.createTestingModule({ imports: [LockModule.forRoot({ redis: client, connectTimeoutMs: 0 })] })
    .setLogger(new CapturingLogger())
    .compile();
  await moduleRef.init();
  try {
    return await moduleRef.get(LockService).acquire('on-closed-client');
  } finally {
    await moduleRef.close();
  }
};
/** Boots on a replica of `redis` started with `args`, stopped whatever the outcome. */
const replicaBoot = async (redis: RedisServer, args: string[] = []) => {
  const replica = await RedisServer.start(['--replicaof', '127.0.0.1', String(redis.port), ...args]);
  try {
    return await boot({ redis: replica.url });
  } finally {
    await replica.stop();
  }
};
/** Boots as a Redis user made with `rules` (ACL SETUSER), which may load scripts. */
const aclBoot = async (redis: RedisServer, user: string, rules: string[]) => {
  await redis.client().call('ACL', 'SETUSER', user, 'reset', 'on', `>${user}-password`, ...rules);
  return boot({ redis: `redis://${user}:${user}-password@127.0.0.1:${redis.port}` });
};
/** A LockOptionsFactory that forgot to return its options. */
class NoOptions implements LockOptionsFactory {
  createLockOptions(): LockModuleOptions {
    return undefined as never;
  }
}
const boot = (options: unknown) => bootModule(LockModule.forRoot(options as LockModuleOptions));
const bootModule = async (module: DynamicModule) => {
  const moduleRef = await Test.createTestingModule({ imports: [module] })
    .setLogger(new CapturingLogger())
    .compile();
  try {
    await moduleRef.init();
  } finally {
    await moduleRef.close();
  }
};
/**
 * A route handler whose call-site parameter (the one @Locked declares after the handler's own) a
 * pipe replaced: called as Nest calls it, with that parameter in place, but a plain object in it.
 */
const replacedCallSite = async (redis: RedisServer, replacement: unknown = { copied: true }) => {
  @Controller('c')
  class C {
    @Get(':id')
    @Locked('c:<0>')
    async get(@Param('id') id: string) {
      return id;
    }
  }
  const moduleRef = await Test.createTestingModule({ imports: [LockModule.forRoot({ redis: redis.url })], controllers: [C] })
    .setLogger(new CapturingLogger())
    .compile();
  await moduleRef.init();
  try {
    return await (moduleRef.get(C).get as (...a: unknown[]) => Promise<unknown>).call(moduleRef.get(C), 'x', replacement);
  } finally {
    await moduleRef.close();
  }
};
/** A `@Locked` method of a provider whose LockService a test replaced with `useValue` (a mock). */
const mockedLockService = async () => {
  @Injectable()
  class P {
    @Locked('p')
    async m() {
      return 'unlocked';
    }
  }
  const moduleRef = await Test.createTestingModule({ providers: [P, { provide: LockService, useValue: { run: async () => undefined } }] }).compile();
  try {
    return await moduleRef.get(P).m();
  } finally {
    await moduleRef.close();
  }
};
/** Runs `fn` with `n` Redis ports that never answer (held until it settles; see silentPort). */
const silently = async <T>(n: number, fn: (ports: number[]) => Promise<T>): Promise<T> => {
  const ports = await Promise.all(Array.from({ length: n }, () => silentPort()));
  try {
    return await fn(ports.map((p) => p.port));
  } finally {
    await Promise.all(ports.map((p) => p.close()));
  }
};
const released = async (locks: LockService, key: string): Promise<LockHandle> => {
  const h = await locks.acquire(key);
  await h.release();
  return h;
};
const lost = async (locks: LockService, redis: RedisServer, key: string): Promise<LockHandle> => {
  const h = await locks.acquire(key);
  await redis.client().del(`lock:{${key}}`);
  await new Promise((resolve) => h.signal.addEventListener('abort', resolve, { once: true }));
  return h;
};

const cases: Case[] = [
  // keys
  { entry: 'acquire(key)', input: 'empty key', outcome: LockKeyError, says: /must not be empty/, run: ({ locks }) => locks.acquire('') },
  { entry: 'acquire(key)', input: `key longer than ${MAX_KEY_LENGTH} characters`, outcome: LockKeyError, says: /at most 1024 characters/, run: ({ locks }) => locks.acquire('k'.repeat(MAX_KEY_LENGTH + 1)) },
  { entry: 'acquire(key)', input: 'non-string key (42)', outcome: LockKeyError, says: /must be a string; got 42/, run: ({ locks }) => locks.acquire(42 as never) },
  { entry: 'acquire(key)', input: 'key with an opening brace', outcome: LockKeyError, says: /remove the braces/, run: ({ locks }) => locks.acquire('a{b') },
  { entry: 'acquire(key)', input: 'key with a closing brace', outcome: LockKeyError, says: /remove the braces/, run: ({ locks }) => locks.acquire('a}b') },
  { entry: 'acquire([keys])', input: 'empty array', outcome: LockKeyError, says: /at least one key/, run: ({ locks }) => locks.acquire([]) },
  { entry: 'run(key, fn)', input: 'fn not a function', outcome: LockConfigurationError, says: /fn must be a function/, run: ({ locks }) => locks.run('k', 5 as never) },
  // durations and options
  { entry: 'acquire(key, { waitMs })', input: 'waitMs NaN', outcome: LockConfigurationError, says: /waitMs must be a whole number .* got NaN/, run: ({ locks }) => locks.acquire('k', { waitMs: NaN }) },
  { entry: 'acquire(key, { waitMs })', input: 'waitMs < 0', outcome: LockConfigurationError, says: /got -1/, run: ({ locks }) => locks.acquire('k', { waitMs: -1 }) },
  { entry: 'acquire(key, { waitMs })', input: 'waitMs 1.5 (not whole)', outcome: LockConfigurationError, says: /got 1.5/, run: ({ locks }) => locks.acquire('k', { waitMs: 1.5 }) },
  { entry: 'acquire(key, { leaseMs })', input: 'leaseMs 0', outcome: LockConfigurationError, says: /from 100/, run: ({ locks }) => locks.acquire('k', { leaseMs: 0 }) },
  { entry: 'acquire(key, { leaseMs })', input: 'leaseMs 50 (too short to renew)', outcome: LockConfigurationError, says: /from 100 .* got 50/, run: ({ locks }) => locks.acquire('k', { leaseMs: 50 }) },
  { entry: 'acquire(key, { leaseMs })', input: 'leaseMs Infinity', outcome: LockConfigurationError, says: /got Infinity/, run: ({ locks }) => locks.acquire('k', { leaseMs: Infinity }) },
  { entry: 'acquire(key, { leaseMs })', input: 'leaseMs above 2147483647', outcome: LockConfigurationError, says: /to 2147483647/, run: ({ locks }) => locks.acquire('k', { leaseMs: 2 ** 31 }) },
  { entry: 'acquire(key, options)', input: 'unknown option', outcome: LockConfigurationError, says: /unknown option "timeout"/, run: ({ locks }) => locks.acquire('k', { timeout: 5 } as never) },
  { entry: 'acquire(key, { owner })', input: 'owner longer than 256 characters', outcome: LockConfigurationError, says: /owner must be a non-empty string of at most 256 characters/, run: ({ locks }) => locks.acquire('k', { owner: 'o'.repeat(257) }) },
  { entry: 'acquire(key, { owner })', input: 'owner starting with ":"', outcome: LockConfigurationError, says: /not starting with ":"/, run: ({ locks }) => locks.acquire('k', { owner: ':mode' }) },
  { entry: 'acquire(key, { owner })', input: 'owner ending with ":read"', outcome: LockConfigurationError, says: /nor ending with ":read"/, run: ({ locks }) => locks.acquire('k', { owner: 'job:read', mode: 'write' }) },
  { entry: 'acquire(key, options)', input: 'options: an array', outcome: LockConfigurationError, says: /LockService.acquire\(\) options must be an object; got an array/, run: ({ locks }) => locks.acquire('k', [{ waitMs: 0 }] as never) },
  { entry: 'acquire(key, { mode, fair })', input: 'fair read lock', outcome: LockConfigurationError, says: /fair mode is for exclusive locks/, run: ({ locks }) => locks.acquire('k', { mode: 'read', fair: true }) },
  { entry: 'tryAcquire(key, { waitMs })', input: 'waitMs given', outcome: LockConfigurationError, says: /never waits/, run: ({ locks }) => locks.tryAcquire('k', { waitMs: 5 } as never) },
  // templates and arguments
  { entry: '@Locked(template)', input: 'unclosed "<"', outcome: LockConfigurationError, says: /unclosed "<"/, run: async () => { class C { @Locked('a:<0') async m(x: string) { return x; } } return C; } },
  { entry: '@Locked(template)', input: 'placeholder beyond the parameters', outcome: LockConfigurationError, says: /declares 1 parameter/, run: async () => { class C { @Locked('a:<3>') async m(x: string) { return x; } } return C; } },
  { entry: 'readLock(key, options)', input: 'options: an empty array', outcome: LockConfigurationError, says: /LockService.readLock\(\) options must be an object; got an array/, run: ({ locks }) => locks.readLock('rw-array', [] as never) },
  { entry: 'readLock(key, options)', input: "mode: 'write'", outcome: LockConfigurationError, says: /LockService.readLock\(\) takes the read side of the lock; got mode "write"\. Leave mode out, or call acquire\(key, \{ mode \}\)/, run: ({ locks }) => locks.readLock('rw-mode', { mode: 'write' } as never) },
  { entry: 'writeLock(key, options)', input: 'fair (write locks are not fair-queued)', outcome: LockConfigurationError, says: /LockService.writeLock\(\): fair mode is for exclusive locks/, run: ({ locks }) => locks.writeLock('k', { fair: true }) },
  { entry: 'writeLock(key, options)', input: "mode: 'exclusive'", outcome: LockConfigurationError, says: /LockService.writeLock\(\) takes the write side of the lock; got mode "exclusive"/, run: ({ locks }) => locks.writeLock('rw-mode', { mode: 'exclusive' } as never) },
  { entry: 'writeLock(key, options)', input: 'waitMs -1', outcome: LockConfigurationError, says: /^LockService.writeLock\(\): waitMs must be/, run: ({ locks }) => locks.writeLock('rw-wait', { waitMs: -1 }) },
  { entry: '@Locked(template, options)', input: 'options: an array', outcome: LockConfigurationError, says: /options must be an object; got an array/, run: async () => { class C { @Locked('a', [{ waitMs: 0 }] as never) async m() {} } return C; } },
  { entry: '@Locked(template, options)', input: 'leaseMs 50 (too short to renew)', outcome: LockConfigurationError, says: /leaseMs must be a whole number of milliseconds from 100 .* got 50/, run: async () => { class C { @Locked('a', { leaseMs: 50 }) async m() {} } return C; } },
  { entry: '@Locked(template, options)', input: 'unknown onContention', outcome: LockConfigurationError, says: /'wait', 'fail' or 'skip'/, run: async () => { class C { @Locked('a', { onContention: 'retry' as never }) async m() {} } return C; } },
  { entry: '@Locked(template, options)', input: 'fair not a boolean', outcome: LockConfigurationError, says: /fair must be true or false; got "yes"/, run: async () => { class C { @Locked('a', { fair: 'yes' as never }) async m() {} } return C; } },
  { entry: '@Locked(template, options)', input: 'minHoldMs -1', outcome: LockConfigurationError, says: /minHoldMs must be a whole number of milliseconds from 0 .*; got -1/, run: async () => { class C { @Locked('a', { minHoldMs: -1 }) async m() {} } return C; } },
  { entry: '@Locked(template, options)', input: 'watchdog not a boolean', outcome: LockConfigurationError, says: /watchdog must be true or false; got "yes"/, run: async () => { class C { @Locked('a', { watchdog: 'yes' as never }) async m() {} } return C; } },
  { entry: '@Locked(template, options)', input: 'minHoldMs with mode read', outcome: LockConfigurationError, says: /@Locked on C\.m: minHoldMs keeps an exclusive or write lock after the call; a read lock is shared.*Leave minHoldMs out, or use mode 'write'/, run: async () => { class C { @Locked('a', { minHoldMs: 1_000, mode: 'read' }) async m() {} } return C; } },
  { entry: '@Locked(template, options)', input: 'fair with mode read', outcome: LockConfigurationError, says: /@Locked on C\.m: fair mode is for exclusive locks/, run: async () => { class C { @Locked('a', { fair: true, mode: 'read' }) async m() {} } return C; } },
  { entry: '@Locked([templates], options)', input: 'several keys with mode write', outcome: LockConfigurationError, says: /@Locked on C\.m: multi-key locks are exclusive; fair and mode apply to one key at a time/, run: async () => { class C { @Locked(['a:<0>', 'b:<1>'], { mode: 'write' }) async m(_a: string, _b: string) {} } return C; } },
  { entry: '@Locked([templates], options)', input: 'several keys with fair', outcome: LockConfigurationError, says: /@Locked on C\.m: multi-key locks are exclusive/, run: async () => { class C { @Locked(['a', 'b'], { fair: true }) async m() {} } return C; } },
  { entry: '@Locked(template, options)', input: "waitMs with onContention 'skip'", outcome: LockConfigurationError, says: /@Locked on C\.m: onContention 'skip' tries the lock once and never waits; leave waitMs out, or use onContention 'wait' to wait up to 5000 ms/, run: async () => { class C { @Locked('a', { onContention: 'skip', waitMs: 5_000 }) async m() {} } return C; } },
  { entry: '@Locked(template, options)', input: "waitMs with onContention 'fail'", outcome: LockConfigurationError, says: /onContention 'fail' tries the lock once and never waits/, run: async () => { class C { @Locked('a', { onContention: 'fail', waitMs: 1 }) async m() {} } return C; } },
  { entry: '@Locked(template, options)', input: 'unknown mode', outcome: LockConfigurationError, says: /mode must be 'read' or 'write' .*; got "shared"/, run: async () => { class C { @Locked('a', { mode: 'shared' as never }) async m() {} } return C; } },
  { entry: '@Locked(fn)', input: 'an async key function (plain JavaScript; TypeScript refuses it)', outcome: LockConfigurationError, says: /@Locked on C\.m: the key function is async; it must return the key itself/, run: async () => { class C { @Locked((async (id: string) => `order:${id}`) as never) async m(_id: string) {} } return C; } },
  { entry: '@Locked(template)', input: 'on a class (plain JavaScript; TypeScript refuses it)', outcome: LockConfigurationError, says: /@Locked on class C: @Locked goes on methods, not on classes/, run: async () => { class C {} (Locked('a') as unknown as ClassDecorator)(C); return C; } },
  { entry: '@Locked(template)', input: 'on a field (plain JavaScript; TypeScript refuses it)', outcome: LockConfigurationError, says: /@Locked on C\.f: @Locked goes on methods, not on accessors or fields/, run: async () => { class C {} (Locked('a') as unknown as PropertyDecorator)(C.prototype, 'f'); return C; } },
  { entry: '@Locked(template)', input: 'on a generator method (function*)', outcome: LockConfigurationError, says: /Make it an async generator/, run: async () => { class C { @Locked('a') *m() { yield 1; } } return C; } },
  { entry: '@Locked method', input: 'LockService replaced by a mock in a test', outcome: LockConfigurationError, says: /import LockTestingModule\.forRoot\(\) in the test instead of a mock/, run: () => mockedLockService() },
  { entry: '@Locked handler', input: 'a pipe replaced the parameter @Locked adds', outcome: LockConfigurationError, says: /a pipe changed it. A global or controller-wide pipe must return the value of a 'custom' parameter it does not know unchanged/, run: ({ redis }) => replacedCallSite(redis) },
  { entry: '@Locked handler', input: 'a pipe replaced the parameter @Locked adds with null', outcome: LockConfigurationError, says: /index 1, .* reached the method as null, not as the LockCallSite Nest filled in: a pipe changed it/, run: ({ redis }) => replacedCallSite(redis, null) },
  // module options and clients
  // Refused when the module is declared (forRoot() throws), before any bootstrap.
  { entry: 'LockModule.forRoot', input: 'isGlobal "false" (a string)', outcome: LockConfigurationError, says: /LockModule.forRoot\(\): isGlobal must be true or false; got "false"/, run: async () => LockModule.forRoot({ isGlobal: 'false' as never }) },
  { entry: 'LockModule.forRootAsync', input: 'isGlobal 1', outcome: LockConfigurationError, says: /LockModule.forRootAsync\(\): isGlobal must be true or false; got 1/, run: async () => LockModule.forRootAsync({ useFactory: () => ({}), isGlobal: 1 as never }) },
  { entry: 'LockModule.forRootAsync', input: 'useFactory null', outcome: LockConfigurationError, says: /useFactory must be a function that returns the options; got null/, run: async () => LockModule.forRootAsync({ useFactory: null as never }) },
  { entry: 'LockModule.forRootAsync', input: 'useClass: an instance instead of the class', outcome: LockConfigurationError, says: /useClass must be a class that implements LockOptionsFactory; got an object \(Object\)/, run: async () => LockModule.forRootAsync({ useClass: { createLockOptions: () => ({}) } as never }) },
  { entry: 'LockModule.forRootAsync', input: 'inject: one class, not an array of them', outcome: LockConfigurationError, says: /LockModule.forRootAsync\(\): inject must be an array of the providers useFactory takes, in its parameters' order; got a function/, run: async () => LockModule.forRootAsync({ inject: LockService as never, useFactory: () => ({}) }) },
  { entry: 'LockModule.forRootAsync', input: 'imports: one module, not an array of them', outcome: LockConfigurationError, says: /imports must be an array of the modules the options need; got a function/, run: async () => LockModule.forRootAsync({ imports: LockModule as never, useFactory: () => ({}) }) },
  { entry: 'LockModule.forRootAsync', input: 'extraProviders: one provider, not an array of them', outcome: LockConfigurationError, says: /extraProviders must be an array of providers; got an object \(Object\)/, run: async () => LockModule.forRootAsync({ extraProviders: { provide: 'X', useValue: 1 } as never, useFactory: () => ({}) }) },
  { entry: 'LockModule.forRoot', input: 'options: an array', outcome: LockConfigurationError, says: /LockModule.forRoot\(\) takes an options object; got an array/, run: async () => LockModule.forRoot([{ leaseMs: 5_000 }] as never) },
  { entry: 'LockTestingModule.forRoot', input: 'options: an empty array', outcome: LockConfigurationError, says: /LockTestingModule.forRoot\(\) takes an options object; got an array/, run: async () => LockTestingModule.forRoot([] as never) },
  { entry: 'LockTestingModule.forRoot', input: 'options: a string', outcome: LockConfigurationError, says: /LockTestingModule.forRoot\(\) takes an options object; got "memory"/, run: async () => LockTestingModule.forRoot('memory' as never) },
  { entry: 'LockTestingModule.forRoot', input: "store: 'redis' (plain JavaScript; TypeScript refuses it)", outcome: LockConfigurationError, says: /LockTestingModule.forRoot\(\) always locks in the memory store of this process; leave store out, or import LockModule.forRoot\(\{ redis \}\)/, run: async () => LockTestingModule.forRoot({ store: 'redis' } as never) },
  { entry: 'LockTestingModule.forRoot', input: 'redis: a URL (plain JavaScript; TypeScript refuses it)', outcome: LockConfigurationError, says: /LockTestingModule.forRoot\(\) always locks in the memory store of this process; leave redis out/, run: async () => LockTestingModule.forRoot({ redis: 'redis://127.0.0.1:1' } as never) },
  { entry: 'LockModule.forRootAsync', input: 'the factory returns an array', outcome: LockConfigurationError, says: /LockModule options must be an object; got an array/, run: () => bootModule(LockModule.forRootAsync({ useFactory: () => [{ leaseMs: 5_000 }] as never })) },
  { entry: 'LockModule.forRootAsync', input: 'the factory returns undefined (a configuration key not set)', outcome: LockConfigurationError, says: /LockModule.forRootAsync\(\): useFactory returned undefined; it must return the options object \(\{\} for every default\)/, run: () => bootModule(LockModule.forRootAsync({ useFactory: () => new Map<string, LockModuleOptions>().get('lock')! })) },
  { entry: 'LockModule.forRootAsync', input: 'the async factory resolves to null', outcome: LockConfigurationError, says: /useFactory returned null; it must return the options object/, run: () => bootModule(LockModule.forRootAsync({ useFactory: async () => null as never })) },
  { entry: 'LockModule.forRootAsync', input: 'useClass whose createLockOptions() returns undefined', outcome: LockConfigurationError, says: /LockModule.forRootAsync\(\): NoOptions.createLockOptions\(\) returned undefined/, run: () => bootModule(LockModule.forRootAsync({ useClass: NoOptions })) },
  { entry: 'LockModule.forRoot', input: 'replication: an array', outcome: LockConfigurationError, says: /replication must be an object like \{ replicas: 1, timeoutMs: 100 \}; got an array/, run: () => boot({ replication: [{ replicas: 1 }] }) },
  { entry: 'LockModule.forRoot', input: 'replication: { replicas: 1.5 }', outcome: LockConfigurationError, says: /replication.replicas must be a whole number of replicas from 1 to 100; got 1.5/, run: () => boot({ replication: { replicas: 1.5 } }) },
  { entry: 'LockModule.forRoot', input: 'redlock: the array of clients itself', outcome: LockConfigurationError, says: /redlock must be an object like \{ clients: \[url1, url2, url3\] \}; got an array/, run: () => boot({ redlock: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'] }) },
  { entry: 'LockModule.forRoot', input: 'leaseMs -1', outcome: LockConfigurationError, says: /leaseMs must be/, run: () => boot({ leaseMs: -1 }) },
  { entry: 'LockModule.forRoot', input: 'unknown option', outcome: LockConfigurationError, says: /did you mean "waitMs"/, run: () => boot({ waitms: 5 }) },
  { entry: 'LockModule.forRoot', input: 'unknown option, a letter missing', outcome: LockConfigurationError, says: /unknown option "leasMs" \(did you mean "leaseMs"\?\)/, run: () => boot({ leasMs: 5_000 }) },
  { entry: 'LockModule.forRoot', input: 'unknown option, a letter too many', outcome: LockConfigurationError, says: /unknown option "leaseeMs" \(did you mean "leaseMs"\?\)/, run: () => boot({ leaseeMs: 5_000 }) },
  { entry: 'LockModule.forRoot', input: 'keyPrefix longer than 256 characters', outcome: LockConfigurationError, says: /keyPrefix must be at most 256 characters/, run: () => boot({ keyPrefix: 'p'.repeat(257) }) },
  { entry: 'LockModule.forRoot', input: 'redis: a Unix socket path as a string', outcome: LockConfigurationError, says: /got the string "unix:\/\/\/run\/redis.sock". For a Unix socket give ioredis options: \{ path: "\/run\/redis.sock" \}/, run: () => boot({ redis: 'unix:///run/redis.sock' }) },
  { entry: 'LockModule.forRoot', input: 'redis: a valkey:// URL with a password', outcome: LockConfigurationError, says: /got the string "valkey:\/\/app:\*\*\*@127.0.0.1:1\/2". Valkey speaks the Redis protocol and ioredis knows only the redis schemes: write "redis:\/\/app:\*\*\*@127.0.0.1:1\/2"/, hides: 's3cret', run: () => boot({ redis: 'valkey://app:s3cret@127.0.0.1:1/2' }) },
  { entry: 'LockModule.forRoot', input: 'redis: a valkeys:// URL (TLS)', outcome: LockConfigurationError, says: /write "rediss:\/\/\*\*\*@127.0.0.1:1"/, hides: 's3cret', run: () => boot({ redis: 'VALKEYS://s3cret@127.0.0.1:1' }) },
  { entry: 'LockModule.forRoot', input: 'redis: "host:port" without a scheme', outcome: LockConfigurationError, says: /got the string "127.0.0.1:1". Add the scheme: "redis:\/\/127.0.0.1:1"/, run: () => boot({ redis: '127.0.0.1:1' }) },
  { entry: 'LockModule.forRoot', input: 'redis: a mistyped URL with a password in its query', outcome: LockConfigurationError, says: /got the string "redis:\/127.0.0.1:1\?db=2&password=\*\*\*"/, hides: 's3cret', run: () => boot({ redis: 'redis:/127.0.0.1:1?db=2&password=s3cret' }) },
  { entry: 'LockModule.forRoot', input: 'redis: a valkey:// URL whose password has an unencoded @', outcome: LockConfigurationError, says: /got the string "valkey:\/\/app:\*\*\*@127.0.0.1:1\/2"/, hides: 's3@cret', run: () => boot({ redis: 'valkey://app:s3@cret@127.0.0.1:1/2' }) },
  { entry: 'LockModule.forRoot', input: 'redis: a mistyped URL with sentinelPassword and Password in its query, and an option after them', outcome: LockConfigurationError, says: /got the string "redis:\/127.0.0.1:1\?sentinelPassword=\*\*\*&Password=\*\*\*&db=2"/, hides: 's3cret', run: () => boot({ redis: 'redis:/127.0.0.1:1?sentinelPassword=s3cret&Password=s3cret&db=2' }) },
  { entry: 'LockModule.forRoot', input: 'redis: a URL whose password has an unencoded #', outcome: LockConfigurationError, says: /redis: the URL "redis:\/\/:\*\*\*@127.0.0.1:1" does not parse. Percent-encode the user name and password/, hides: 's3#cret', run: () => boot({ redis: 'redis://:s3#cret@127.0.0.1:1' }) },
  { entry: 'LockModule.forRoot', input: 'redis: a URL whose password has a % that encodes nothing', outcome: LockConfigurationError, says: /does not parse. Percent-encode/, hides: 's3%zzcret', run: () => boot({ redis: 'redis://:s3%zzcret@127.0.0.1:1' }) },
  { entry: 'LockModule.forRoot', input: 'redis: a URL whose user name has a % that encodes nothing', outcome: LockConfigurationError, says: /does not parse. Percent-encode/, run: () => boot({ redis: 'redis://us%zzer:pw@127.0.0.1:1' }) },
  { entry: 'LockModule.forRoot', input: 'redis: a URL with a port that is not a number (redis://host:${unset})', outcome: LockConfigurationError, says: /redis: the URL "redis:\/\/127.0.0.1:undefined" does not parse/, run: () => boot({ redis: 'redis://127.0.0.1:undefined' }) },
  { entry: 'LockModule.forRoot', input: 'redis: a URL with port 0', outcome: LockConfigurationError, says: /the URL "redis:\/\/127.0.0.1:0" has port 0; a port is a number from 1 to 65535/, run: () => boot({ redis: 'redis://127.0.0.1:0' }) },
  { entry: 'LockModule.forRoot', input: 'redis: a URL with no host (redis://${empty}:6379 makes "redis://:6379"; "redis://" alone)', outcome: LockConfigurationError, says: /the URL "redis:\/\/" names no host, and ioredis would connect to localhost:6379/, run: () => boot({ redis: 'redis://' }) },
  { entry: 'LockModule.forRoot', input: 'redis: { port: NaN } (Number() of an unset variable)', outcome: LockConfigurationError, says: /redis: port must be a whole number from 1 to 65535 .*; got NaN/, run: () => boot({ redis: { host: '127.0.0.1', port: Number(undefined) } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { port: "" } (an empty variable)', outcome: LockConfigurationError, says: /redis: port must be .*; got ""/, run: () => boot({ redis: { host: '127.0.0.1', port: '' as never } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { port: 6379.5 }', outcome: LockConfigurationError, says: /redis: port must be a whole number .*; got 6379.5/, run: () => boot({ redis: { host: '127.0.0.1', port: 6379.5 } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { host: " " } (a variable set to a space)', outcome: LockConfigurationError, says: /redis: host must be a host name or an address; got " "/, run: () => boot({ redis: { host: ' ', port: 1 } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { host: 127001 } (a number)', outcome: LockConfigurationError, says: /redis: host must be a host name or an address; got 127001\.$/, run: () => boot({ redis: { host: 127001 as never, port: 1 } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { port: 65536 }', outcome: LockConfigurationError, says: /redis: port must be .*; got 65536/, run: () => boot({ redis: { host: '127.0.0.1', port: 65_536 } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { host: "" } (an empty variable)', outcome: LockConfigurationError, says: /redis: host must be a host name or an address; got "". ioredis would connect to localhost instead/, run: () => boot({ redis: { host: '', port: 1 } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { sentinels } with a port NaN', outcome: LockConfigurationError, says: /a redis.sentinels entry: port must be .*; got NaN/, run: () => boot({ redis: { sentinels: [{ host: '127.0.0.1', port: Number.NaN }], name: 'mymaster' } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { sentinels } without name', outcome: LockConfigurationError, says: /redis: with sentinels, name must be the name of the master the sentinels monitor .*; got undefined/, run: () => boot({ redis: { sentinels: [{ host: '127.0.0.1', port: 1 }] } }) },
  { entry: 'LockModule.forRoot', input: "redis: { sentinels, name, role: 'slave' } (a replica)", outcome: LockConfigurationError, says: /redis: with sentinels, role must be 'master' \(or left out\); got "slave". ioredis would connect to a replica/, run: () => boot({ redis: { sentinels: [{ host: '127.0.0.1', port: 1 }], name: 'mymaster', role: 'slave' } }) },
  { entry: 'LockModule.forRoot', input: "redis: { sentinels, name: '' }", outcome: LockConfigurationError, says: /redis: with sentinels, name must be the name of the master .*; got ""/, run: () => boot({ redis: { sentinels: [{ host: '127.0.0.1', port: 1 }], name: '' } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { sentinels: [] }', outcome: LockConfigurationError, says: /redis.sentinels must be a non-empty array of \{ host, port \} objects; got an empty array/, run: () => boot({ redis: { sentinels: [], name: 'mymaster' } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { sentinels } as one string (an environment variable)', outcome: LockConfigurationError, says: /redis.sentinels must be .*; got "127.0.0.1:1,127.0.0.1:2". Split a list/, run: () => boot({ redis: { sentinels: '127.0.0.1:1,127.0.0.1:2' as never, name: 'mymaster' } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { sentinels } with "host:port" strings', outcome: LockConfigurationError, says: /redis.sentinels must be .*; got an array with an entry that is not an object/, run: () => boot({ redis: { sentinels: ['127.0.0.1:1'] as never, name: 'mymaster' } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { cluster } with a startup node URL whose password has an unencoded #', outcome: LockConfigurationError, says: /a redis.cluster startup node "redis:\/\/:\*\*\*@127.0.0.1:7000" does not parse. Percent-encode/, hides: 's3#cret', run: () => boot({ redis: { cluster: ['redis://:s3#cret@127.0.0.1:7000'] } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { cluster } with a startup node "host:port" whose port is not a number', outcome: LockConfigurationError, says: /a redis.cluster startup node, read as "redis:\/\/127.0.0.1:undefined" does not parse/, run: () => boot({ redis: { cluster: ['127.0.0.1:undefined'] } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { cluster } with a valkey:// startup node', outcome: LockConfigurationError, says: /a redis.cluster startup node must be a redis:\/\/ URL, "host:port" or \{ host, port \}; got "valkey:\/\/127.0.0.1:7000"/, run: () => boot({ redis: { cluster: ['valkey://127.0.0.1:7000'] } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { cluster } with a startup node on port NaN', outcome: LockConfigurationError, says: /a redis.cluster startup node: port must be .*; got NaN/, run: () => boot({ redis: { cluster: [{ host: '127.0.0.1', port: Number.NaN }] } }) },
  { entry: 'LockModule.forRoot', input: 'redlock: a client with a port NaN', outcome: LockConfigurationError, says: /redis: port must be .*; got NaN/, run: () => boot({ redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', { host: '127.0.0.1', port: Number.NaN }] } }) },
  { entry: 'LockModule.forRoot', input: 'redis: a node-redis client', outcome: LockConfigurationError, says: /needs an ioredis client/, run: () => boot({ redis: { evalSha: () => 0, isOpen: true } }) },
  { entry: 'LockModule.forRoot', input: 'redis: autoResendUnfulfilledCommands false', outcome: LockConfigurationError, says: /a lock release could wait for ever/, run: () => boot({ redis: { port: 1, autoResendUnfulfilledCommands: false } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { cluster, options: { redisOptions: { autoResendUnfulfilledCommands: false } } }', outcome: LockConfigurationError, says: /a lock release could wait for ever/, run: () => boot({ redis: { cluster: [{ host: '127.0.0.1', port: 1 }], options: { redisOptions: { autoResendUnfulfilledCommands: false } } } }) },
  { entry: 'LockModule.forRoot', input: 'redis: a client the application closed (disconnect())', outcome: LockConfigurationError, says: /the ioredis client passed in for redis 127\.0\.0\.1:\d+ was closed \(quit\(\) or disconnect\(\)\), and ioredis does not reopen a closed client/, run: ({ redis }) => closedClientBoot(redis) },
  { entry: 'acquire(key)', input: 'on a client the application closed, with connectTimeoutMs: 0', outcome: LockBackendError, says: /Redis failed during acquire of "on-closed-client": Connection is closed\. Check that Redis is reachable/, run: ({ redis }) => closedClientAcquire(redis) },
  { entry: 'LockModule.forRoot', input: "redis: { url } (node-redis's option, ignored by ioredis)", outcome: LockConfigurationError, says: /redis: ioredis options have no "url" \(that is node-redis's createClient\(\) option\), and ioredis would connect to localhost:6379 instead/, run: () => boot({ redis: { url: 'redis://127.0.0.1:1' } }) },
  { entry: 'LockModule.forRoot', input: "redis: { socket: { host, port } } (node-redis's)", outcome: LockConfigurationError, says: /ioredis options have no "socket"/, run: () => boot({ redis: { socket: { host: '127.0.0.1', port: 1 } } }) },
  { entry: 'LockModule.forRoot', input: 'redlock: a client given as { url }', outcome: LockConfigurationError, says: /ioredis options have no "url"/, run: () => boot({ redlock: { clients: [{ url: 'redis://127.0.0.1:1' }, 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'] } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { hostname, port } (a URL object\'s name for host)', outcome: LockConfigurationError, says: /redis: ioredis options have no "hostname" \(ioredis calls it host\).*Write \{ host: "127.0.0.1" \}/, run: () => boot({ redis: { hostname: '127.0.0.1', port: 1 } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { host } given a URL', outcome: LockConfigurationError, says: /redis: host must be a host name, not a URL; got "redis:\/\/127.0.0.1:1"/, run: () => boot({ redis: { host: 'redis://127.0.0.1:1' } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { host } given a URL with a password', outcome: LockConfigurationError, says: /got "redis:\/\/:\*\*\*@127.0.0.1:1"/, hides: 's3cret', run: () => boot({ redis: { host: 'redis://:s3cret@127.0.0.1:1' } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { host } given a URL with a password longer than a message shows', outcome: LockConfigurationError, says: /got "redis:\/\/:\*\*\*@127.0.0.1:1"/, hides: 'long-s3cret', run: () => boot({ redis: { host: `redis://:long-s3cret${'0'.repeat(90)}@127.0.0.1:1` } }) },
  { entry: 'LockModule.forRoot', input: 'redis: not a client (a Map)', outcome: LockConfigurationError, says: /not an ioredis client/, run: () => boot({ redis: new Map() }) },
  { entry: 'LockModule.forRoot', input: 'redis: { cluster: [] }', outcome: LockConfigurationError, says: /redis.cluster must be a non-empty array of startup nodes/, run: () => boot({ redis: { cluster: [] } }) },
  { entry: 'LockModule.forRoot', input: 'redis: { cluster } given one URL with a password', outcome: LockConfigurationError, says: /must be a non-empty array of startup nodes .*; got "redis:\/\/:\*\*\*@127.0.0.1:7000"/, hides: 's3cret', run: () => boot({ redis: { cluster: 'redis://:s3cret@127.0.0.1:7000' } as never }) },
  { entry: 'LockModule.forRoot', input: 'redis: { cluster, host } (a stray field)', outcome: LockConfigurationError, says: /move host into options/, run: () => boot({ redis: { cluster: [{ host: '127.0.0.1', port: 7000 }], host: 'x' } as never }) },
  { entry: 'LockModule.forRoot', input: 'Redis Cluster unreachable at bootstrap', outcome: LockBackendError, says: /no answer from redis cluster .* connectTimeoutMs: 0/, run: () => silently(1, ([port]) => boot({ redis: { cluster: [{ host: '127.0.0.1', port }] }, connectTimeoutMs: 300 })) },
  { entry: 'LockModule.forRoot', input: 'replication: { replicas: 0 }', outcome: LockConfigurationError, says: /replication.replicas must be a whole number of replicas from 1/, run: () => boot({ replication: { replicas: 0 } }) },
  { entry: 'LockModule.forRoot', input: 'replication: { replicas: 101 }', outcome: LockConfigurationError, says: /replication.replicas must be a whole number of replicas from 1 to 100; got 101/, run: () => boot({ replication: { replicas: 101 } }) },
  { entry: 'LockModule.forRoot', input: "replication: { onUnconfirmedAcquire: 'ignore' }", outcome: LockConfigurationError, says: /replication.onUnconfirmedAcquire must be 'rollback' or 'keep'; got "ignore"/, run: () => boot({ replication: { replicas: 1, onUnconfirmedAcquire: 'ignore' } }) },
  { entry: 'LockModule.forRoot', input: 'replication: { replicas: 1, timeoutMs: -1 }', outcome: LockConfigurationError, says: /replication.timeoutMs must be a whole number of milliseconds/, run: () => boot({ replication: { replicas: 1, timeoutMs: -1 } }) },
  { entry: 'LockModule.forRoot', input: 'replication: { replicas: 1, timeoutMs: 0 } (WAIT 0 blocks for ever)', outcome: LockConfigurationError, says: /replication.timeoutMs must be a whole number of milliseconds from 1 to .*; got 0/, run: () => boot({ replication: { replicas: 1, timeoutMs: 0 } }) },
  { entry: 'LockModule.forRoot', input: 'replication with a Redis Cluster', outcome: LockConfigurationError, says: /on Redis Cluster WAIT cannot follow a lock/, run: () => boot({ redis: { cluster: [{ host: '127.0.0.1', port: 7000 }] }, replication: { replicas: 1 } }) },
  { entry: 'LockModule.forRoot', input: 'replication with an ioredis Cluster client', outcome: LockConfigurationError, says: /on Redis Cluster WAIT cannot follow a lock/, run: async () => { const client = new Cluster([{ host: '127.0.0.1', port: 1 }], { lazyConnect: true }); try { return await boot({ redis: client, replication: { replicas: 1 } }); } finally { client.disconnect(); } } },
  { entry: 'LockModule.forRoot', input: 'redlock: 1 client', outcome: LockConfigurationError, says: /odd number of at least 3 independent Redis masters .*; got 1/, run: () => boot({ redlock: { clients: ['redis://127.0.0.1:1'] } }) },
  { entry: 'LockModule.forRoot', input: 'redlock: 2 clients', outcome: LockConfigurationError, says: /odd number of at least 3 independent Redis masters .*; got 2/, run: () => boot({ redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2'] } }) },
  { entry: 'LockModule.forRoot', input: 'redlock: 4 clients', outcome: LockConfigurationError, says: /odd number of at least 3 independent Redis masters .*; got 4/, run: () => boot({ redlock: { clients: [1, 2, 3, 4].map((port) => `redis://127.0.0.1:${port}`) } }) },
  { entry: 'LockModule.forRoot', input: 'redlock: Sentinel options among the clients', outcome: LockConfigurationError, says: /do not give Sentinel options/, run: () => boot({ redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', { sentinels: [{ host: '127.0.0.1', port: 1 }], name: 'mymaster' }] } }) },
  { entry: 'LockModule.forRoot', input: "redlock with store 'memory'", outcome: LockConfigurationError, says: /store 'memory' keeps locks in this process; leave redlock out with it/, run: () => boot({ store: 'memory', redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'] } }) },
  { entry: 'LockModule.forRoot', input: 'redlock: an ioredis Cluster client among the clients', outcome: LockConfigurationError, says: /a Redis Cluster cannot be one of them/, run: async () => { const client = new Cluster([{ host: '127.0.0.1', port: 1 }], { lazyConnect: true }); try { return await boot({ redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', client] } }); } finally { client.disconnect(); } } },
  { entry: 'LockModule.forRoot', input: 'redlock: { cluster } among the clients', outcome: LockConfigurationError, says: /a Redis Cluster cannot be one of them/, run: () => boot({ redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', { cluster: [{ host: '127.0.0.1', port: 7000 }] } as never] } }) },
  { entry: 'LockModule.forRoot', input: 'redlock and redis together', outcome: LockConfigurationError, says: /either redis .* or redlock/, run: () => boot({ redis: 'redis://127.0.0.1:1', redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'] } }) },
  { entry: 'LockModule.forRoot', input: 'redlock: driftFactor 0.6', outcome: LockConfigurationError, says: /driftFactor must be a number from 0 to below 0.5/, run: () => boot({ redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'], driftFactor: 0.6 } }) },
  { entry: 'LockModule.forRoot', input: 'redlock: driftFactor 0.5', outcome: LockConfigurationError, says: /driftFactor must be a number from 0 to below 0.5 .*; got 0.5/, run: () => boot({ redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'], driftFactor: 0.5 } }) },
  { entry: 'LockModule.forRoot', input: 'redlock: driftFactor -0.01', outcome: LockConfigurationError, says: /driftFactor must be a number from 0 to below 0.5 .*; got -0.01/, run: () => boot({ redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'], driftFactor: -0.01 } }) },
  { entry: 'LockModule.forRoot', input: 'Redis Cluster unreachable, startup nodes given as URLs with a password', outcome: LockBackendError, says: /no answer from redis cluster redis:\/\/:\*\*\*@127.0.0.1:\d+ within/, hides: 's3cret', run: () => silently(1, ([port]) => boot({ redis: { cluster: [`redis://:s3cret@127.0.0.1:${port}`] }, connectTimeoutMs: 300 })) },
  { entry: 'LockModule.forRoot', input: 'redlock: every node unreachable at bootstrap', outcome: LockBackendError, says: /needs 2 of 3 nodes; 0 answered/, run: () => silently(3, (ports) => boot({ redlock: { clients: ports.map((port) => `redis://127.0.0.1:${port}`) }, connectTimeoutMs: 300 })) },
  { entry: 'LockModule.forRoot', input: 'Redis unreachable at bootstrap', outcome: LockBackendError, says: /no answer from redis .* connectTimeoutMs: 0/, run: () => silently(1, ([port]) => boot({ redis: `redis://127.0.0.1:${port}`, connectTimeoutMs: 200 })) },
  { entry: 'LockModule.forRoot', input: 'Redis older than 6.2', outcome: LockConfigurationError, says: /runs Redis 6\.0.* needs Redis 6\.2 or later/, run: async () => { const { server: old } = await olderRedis(); try { return await boot({ redis: old.url }); } finally { await old.stop(); } } },
  { entry: 'LockModule.forRoot', input: 'redis: a read-only replica', outcome: LockConfigurationError, says: /redis 127.0.0.1:\d+ is a replica of 127.0.0.1:\d+: every lock step writes, which a read-only replica refuses \(READONLY\).* Point redis at the master/, run: ({ redis }) => replicaBoot(redis) },
  { entry: 'LockModule.forRoot', input: 'redis: a writable replica (replica-read-only no)', outcome: LockConfigurationError, says: /is a replica of 127.0.0.1:\d+: .*a writable one keeps to itself, unseen by its master/, run: ({ redis }) => replicaBoot(redis, ['--replica-read-only', 'no']) },
  { entry: 'LockModule.forRoot', input: 'redis: a user whose ACL keys are not the lock names (~other:*)', outcome: LockConfigurationError, says: /redis 127.0.0.1:\d+: this connection's Redis user may not run any command on the lock names \(lock:\*\), which the lock scripts call, so every acquisition would fail. Allow them, for example ACL SETUSER <user> ~lock:\* \+@read \+@write \+time/, run: ({ redis }) => aclBoot(redis, 'otherkeys', ['~other:*', '&*', '+@all']) },
  { entry: 'LockModule.forRoot', input: 'redis: a user without the hash and list commands (+@string only)', outcome: LockConfigurationError, says: /may not run exists, del, pexpire, pttl, hget, hset, hdel, hexists, hincrby, hkeys, hlen, rpush, lpop, lindex, lrem, zadd, zrem, zcard, zrange, zrangebyscore, zremrangebyscore on the lock names/, run: ({ redis }) => aclBoot(redis, 'stringsonly', ['~lock:*', '&lock:*', '-@all', '+@scripting', '+@string', '+@pubsub', '+@connection', '+info', '+time']) },
  { entry: 'LockModule.forRoot', input: 'redis: a user without TIME, which the scripts call for fencing tokens', outcome: LockConfigurationError, says: /this connection's Redis user may not run time on the lock names \(lock:\*\)/, run: ({ redis }) => aclBoot(redis, 'notime', ['~lock:*', '&lock:*', '-@all', '+@scripting', '+@read', '+@write', '+@pubsub', '+@connection', '+info']) },
  { entry: 'LockModule.forRoot', input: 'redis: a wrong password', outcome: LockBackendError, says: /the connection failed with: WRONGPASS invalid username-password pair/, run: ({ redis }) => boot({ redis: `redis://nobody:wrong-password@127.0.0.1:${redis.port}`, connectTimeoutMs: 1_000 }) },
  // Redis errors
  { entry: 'acquire(key)', input: 'the key is used by other code (WRONGTYPE)', outcome: LockBackendError, says: /lock keys are not used by other code/, run: async ({ locks, redis }) => { await redis.client().set('lock:{taken-by-app}', 'x'); return locks.acquire('taken-by-app'); } },
  // handles
  { entry: 'handle.release()', input: 'release twice', outcome: 'no-op', run: async ({ locks }) => (await released(locks, 'twice')).release() },
  { entry: 'handle.release()', input: 'release after loss', outcome: 'no-op', run: async ({ locks, redis }) => (await lost(locks, redis, 'lost-release')).release() },
  { entry: 'handle.extend(ms)', input: 'extend after loss', outcome: LockLostError, says: /was lost/, run: async ({ locks, redis }) => (await lost(locks, redis, 'lost-extend')).extend(1_000) },
  { entry: 'handle.extend(ms)', input: 'extend after release', outcome: LockError, says: /already released; acquire the lock again/, run: async ({ locks }) => (await released(locks, 'released-extend')).extend(1_000) },
  { entry: 'handle.extend(ms)', input: 'extend(10)', outcome: LockConfigurationError, says: /got 10/, run: async ({ locks }) => { const h = await locks.acquire('short-extend'); try { return await h.extend(10); } finally { await h.release(); } } },
  { entry: 'handle.run(fn)', input: 'fn not a function', outcome: LockConfigurationError, says: /LockHandle.run\(fn\): fn must be a function to run in the lock's context; got "work"/, run: async ({ locks }) => { const h = await locks.acquire('run-not-fn'); try { return h.run('work' as never); } finally { if (!h.isHeld) throw new Error('no longer held'); await h.release(); } } },
  { entry: 'group.run(fn)', input: 'fn not a function', outcome: LockConfigurationError, says: /LockGroup.run\(fn\): fn must be a function .*; got null/, run: async ({ locks }) => { const g = await locks.acquire(['group-run-a', 'group-run-b']); try { return g.run(null as never); } finally { if (!g.isHeld) throw new Error('no longer held'); await g.release(); } } },
  { entry: 'group.extend(ms)', input: 'extend(10)', outcome: LockConfigurationError, says: /LockGroup.extend\(\): leaseMs must be a whole number of milliseconds from 100 .*; got 10/, run: async ({ locks }) => { const g = await locks.acquire(['short-group-a', 'short-group-b']); try { return await g.extend(10); } finally { await g.release(); } } },
  { entry: 'forceUnlock(key)', input: 'missing key', outcome: 'no-op', run: ({ locks }) => locks.forceUnlock('never-held') },
  // questions about holds: a key that cannot be held, an option that only shapes an acquisition
  { entry: 'current(key)', input: 'a number (an id not yet made a key)', outcome: LockKeyError, says: /LockService.current\(\): a lock key must be a string; got 42/, run: async ({ locks }) => locks.run('held-42', () => locks.current(42 as never)) },
  { entry: 'current(key)', input: 'an array of keys', outcome: LockKeyError, says: /LockService.current\(\): a lock key must be a string; got an array/, run: async ({ locks }) => locks.run(['held-a', 'held-b'], () => locks.current(['held-a', 'held-b'] as never)) },
  { entry: 'holdCount(key, options)', input: 'waitMs (an acquisition option)', outcome: LockConfigurationError, says: /LockService.holdCount\(\): unknown option "waitMs". Known options: owner, mode/, run: ({ locks }) => locks.holdCount('counted', { waitMs: 0 } as never) },
  { entry: 'holdCount(key, options)', input: 'an array', outcome: LockConfigurationError, says: /LockService.holdCount\(\) options must be an object; got an array/, run: ({ locks }) => locks.holdCount('counted', [] as never) },
  // health probes: a timeout read from the environment without Number(), or one no timer holds
  { entry: 'health(timeoutMs)', input: 'timeoutMs "500" (a string)', outcome: LockConfigurationError, says: /LockService.health\(\): timeoutMs must be a whole number of milliseconds from 0 to 2147483647 \(or Infinity to wait for ever\); got "500"/, run: ({ locks }) => locks.health('500' as never) },
  { entry: 'health(timeoutMs)', input: 'timeoutMs NaN', outcome: LockConfigurationError, says: /timeoutMs must be .*; got NaN/, run: ({ locks }) => locks.health(Number.NaN) },
  { entry: 'health(timeoutMs)', input: 'timeoutMs 3000000000 (more than a timer holds)', outcome: LockConfigurationError, says: /timeoutMs must be .*; got 3000000000/, run: ({ locks }) => locks.health(3_000_000_000) },
];

const table = () =>
  [
    '| entry point | bad input | outcome |',
    '|---|---|---|',
    ...cases.map((c) => `| \`${c.entry}\` | ${c.input} | ${c.outcome === 'no-op' ? 'documented no-op' : `\`${c.outcome.name}\``}${c.says ? ` (message: "${c.says.source.replace(/\.\*/g, '…').replace(/\\/g, '').replace(/\|/g, '\\|')}"${c.hides ? `, without "${c.hides}"` : ''})` : ''} |`),
  ].join('\n');

describe('bad input on every public entry point', () => {
  let redis: RedisServer;
  let app: LockApp;
  let sentinel: LockHandle;
  let raw: Redis;
  usePrivateLockApp({ leaseMs: 600 }, (started) => ({ redis, raw, app } = started));
  beforeAll(async () => {
    sentinel = await app.locks.acquire('sentinel', { owner: 'someone-else' });
  });

  it.each(cases.map((c) => [`${c.entry}: ${c.input}`, c] as const))('%s', async (_name, c) => {
    const before = { hash: await raw.hgetall('lock:{sentinel}'), ttl: await raw.pttl('lock:{sentinel}') };
    const outcome = await c.run({ locks: app.locks, redis }).then(() => 'no-op' as const, (e: unknown) => e);
    if (c.outcome === 'no-op') expect(outcome).toBe('no-op');
    else {
      expect(outcome).toBeInstanceOf(c.outcome);
      expect(outcome).toBeInstanceOf(LockError);
      expect((outcome as Error).name).toBe(c.outcome.name); // the stable name each class promises
      expect((outcome as Error).message).toMatch(c.says!);
      if (c.hides) expect(`${(outcome as Error).message} ${String((outcome as Error).cause ?? '')}`).not.toContain(c.hides);
    }
    // Another owner's lock is untouched, and nothing is left waiting or renewing for this case.
    expect(await raw.hgetall('lock:{sentinel}')).toEqual(before.hash);
    expect(sentinel.signal.aborted).toBe(false);
    const internals = app.locks as unknown as { store: { waitState: { channels: number; waiters: number } }; watchdog: { size: number } };
    expect(internals.store.waitState).toEqual({ channels: 0, waiters: 0 });
    expect(internals.watchdog.size).toBe(1); // the sentinel only
  });

  it('publishes the same table in TESTING.md', () => {
    const file = join(root, 'TESTING.md');
    const text = readFileSync(file, 'utf8');
    const begin = '<!-- bad-input table: generated by test/faults/bad-input.spec.ts -->';
    const end = '<!-- end of bad-input table -->';
    const generated = `${begin}\n${table()}\n${end}`;
    const current = text.slice(text.indexOf(begin), text.indexOf(end) + end.length);
    if (process.env.UPDATE_TESTING_MD === '1') writeFileSync(file, text.replace(current, generated));
    else expect(current).toBe(generated);
  });
});
