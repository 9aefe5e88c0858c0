import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Injectable, Module, type BeforeApplicationShutdown, type OnModuleDestroy } from '@nestjs/common';
import { Test } from '@nestjs/testing';
import { Cluster, Redis } from 'ioredis';
import { connect } from 'node:net';
import { performance } from 'node:perf_hooks';
import {
  Locked,
  LockBackendError,
  LockConfigurationError,
  LockLostError,
  LockModule,
  LockNotAcquiredError,
  LockService,
  type LockHandle,
  type LockModuleOptions,
  type LockOptionsFactory,
} from '../../lib/index.js';
import { withTimeout } from '../../lib/internal/time.js';
import { bootstrapFailure, CapturingLogger, gate, listenerCounts, nextEvents, startLockApp, timersLeftBy, waitRegistered, within } from '../support/lock-testing.js';
import { freePort, olderRedis, olderRedisProxy, RedisServer, scriptCalls, serverIdentity, silentPort, until } from '../support/redis-server.js';
import { Fixture } from '../support/children.js';

describe('LockModule', () => {
  let redis: RedisServer;
  beforeAll(async () => {
    redis = await RedisServer.start();
  });
  afterAll(async () => {
    await redis?.stop();
  });

  it('runs on the Nest and ioredis majors this run was started for', async () => {
    const core = (await import('@nestjs/core/package.json', { with: { type: 'json' } })).default as { version: string };
    const ioredis = (await import('ioredis/package.json', { with: { type: 'json' } })).default as { version: string };
    const legacy = process.env.NEST_MAJOR === '11';
    expect(core.version.split('.')[0]).toBe(legacy ? '11' : '12');
    expect(ioredis.version.split('.')[0]).toBe(legacy ? '5' : '6');
    // The GraphQL test runs on the @nestjs/graphql of this run's Nest major (compat/ holds its own).
    const graphql = (await import('@nestjs/graphql/package.json', { with: { type: 'json' } })).default as { version: string };
    expect(graphql.version.split('.')[0]).toBe(legacy ? '13' : '14');
    const mercurius = (await import('@nestjs/mercurius/package.json', { with: { type: 'json' } })).default as { version: string };
    expect(mercurius.version.split('.')[0]).toBe(legacy ? '13' : '14');
    // So does the OpenAPI test, on the @nestjs/swagger of this run's Nest major.
    const swagger = (await import('@nestjs/swagger/package.json', { with: { type: 'json' } })).default as { version: string };
    expect(swagger.version.split('.')[0]).toBe(legacy ? '11' : '12');
    // And the CQRS test, on the @nestjs/cqrs of this run's Nest major (12 asks for Nest 12).
    const cqrs = (await import('@nestjs/cqrs/package.json', { with: { type: 'json' } })).default as { version: string };
    expect(cqrs.version.split('.')[0]).toBe(legacy ? '11' : '12');
  });

  it('runs on the floors of the peer ranges where this run was started for them (the Nest 11 and the Nest 12 floor runs)', async () => {
    // The floor runs use the oldest release of each peer range, so a feature newer than the floor
    // shows there (the newest Nest 12 run, and the packaging test's apps, use the newest releases).
    const own = (await import('../../package.json', { with: { type: 'json' } })).default as { peerDependencies: Record<string, string> };
    const compat = process.env.NEST_COMPAT || (process.env.NEST_MAJOR === '11' ? 'nest11' : '');
    const nest = compat === 'nest12' ? '12' : '11';
    const peers = { '@nestjs/common': nest, '@nestjs/core': nest, '@nestjs/microservices': nest, '@nestjs/websockets': nest, ioredis: nest === '12' ? '6' : '5', rxjs: '7', 'reflect-metadata': '0' };
    // Where Nest did not publish a usable x.0.0: @nestjs/core 12.0.0 asks for @nestjs/common ^11 as
    // its peer, and @nestjs/microservices and @nestjs/websockets 12 start at 12.0.1.
    const oldestInstallable: Record<string, string> = nest === '12' ? { '@nestjs/core': '12.0.1', '@nestjs/microservices': '12.0.1', '@nestjs/websockets': '12.0.1' } : {};
    for (const [name, major] of Object.entries(peers)) {
      const floor = new RegExp(`\\^(${major}\\.\\d+\\.\\d+)`).exec(own.peerDependencies[name]!)?.[1];
      expect([name, floor]).toEqual([name, expect.stringMatching(/^\d+\.\d+\.\d+$/)]);
      if (!compat) continue;
      const installed = (await import(`${name}/package.json`, { with: { type: 'json' } })).default as { version: string };
      expect([name, installed.version]).toEqual([name, oldestInstallable[name] ?? floor]);
    }
    if (!compat) return;
    // An app's @nestjs/testing comes with its @nestjs/core: a newer one overrides injector methods
    // that core does not have yet (11.2's useMocker() never ran on core 11.0.0).
    const [core, testing] = await Promise.all(
      ['@nestjs/core', '@nestjs/testing'].map(async (name) => ((await import(`${name}/package.json`, { with: { type: 'json' } })).default as { version: string }).version),
    );
    expect(['@nestjs/testing', testing]).toEqual(['@nestjs/testing', core]);
  });

  const compile = (options: unknown) =>
    Test.createTestingModule({ imports: [LockModule.forRoot(options as LockModuleOptions)] })
      .setLogger(new CapturingLogger())
      .compile();

  it.each([
    [{ leaseMs: -1 }, 'leaseMs', /leaseMs must be a whole number of milliseconds from 100 to 2147483647; got -1/],
    [{ leaseMs: 50 }, 'leaseMs', /from 100 .* got 50/],
    [{ leaseMs: 1.5 }, 'leaseMs', /got 1.5/],
    [{ leaseMs: Infinity }, 'leaseMs', /got Infinity/],
    [{ waitMs: NaN }, 'waitMs', /waitMs must be .* \(or Infinity to wait for ever\); got NaN/],
    [{ waitMs: -5 }, 'waitMs', /got -5/],
    [{ connectTimeoutMs: '1000' }, 'connectTimeoutMs', /got "1000"/],
    [{ watchdog: 'yes' }, 'watchdog', /watchdog must be true or false; got "yes"/],
    [{ keyPrefix: 'app:{x}:' }, 'keyPrefix', /without "\{" or "\}"/],
    [{ keyPrefix: 7 }, 'keyPrefix', /keyPrefix must be a string; got 7/],
    [{ redis: 6379 }, 'redis', /redis must be a redis:\/\/ URL, ioredis options, or an ioredis client; got 6379/],
    [{ redis: 'http://127.0.0.1:6379' }, 'redis', /redis:\/\/ or rediss:\/\/ URL/],
    [{ redis: { evalSha: () => 0, isOpen: true, duplicate: () => 0 } }, 'redis', /looks like a node-redis client/],
    [{ redis: new Map() }, 'redis', /class Map that is not an ioredis client/],
    [{ redis: { host: '127.0.0.1', port: 1, autoResendUnfulfilledCommands: false } }, 'redis', /ioredis options with autoResendUnfulfilledCommands: false\. .*could wait for ever/],
    [{ redis: new Redis({ port: 1, lazyConnect: true, autoResendUnfulfilledCommands: false }) }, 'redis', /an ioredis client with autoResendUnfulfilledCommands: false/],
    [
      { redis: { cluster: [{ host: '127.0.0.1', port: 1 }], options: { redisOptions: { autoResendUnfulfilledCommands: false } } } },
      'redis',
      /redis\.cluster options whose redisOptions have autoResendUnfulfilledCommands: false/,
    ],
    [
      { redis: new Cluster([{ host: '127.0.0.1', port: 1 }], { lazyConnect: true, redisOptions: { autoResendUnfulfilledCommands: false } }) },
      'redis',
      /an ioredis Cluster client whose redisOptions have autoResendUnfulfilledCommands: false/,
    ],
    [
      { redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', { port: 3, autoResendUnfulfilledCommands: false }] } },
      'redis',
      /ioredis options with autoResendUnfulfilledCommands: false/,
    ],
    [{ leaseMS: 1000 }, 'leaseMS', /unknown option "leaseMS" \(did you mean "leaseMs"\?\)/],
    [{ leaseMs: () => 1_000 }, 'leaseMs', /leaseMs must be .*; got a function/],
    [{ waitMs: [] }, 'waitMs', /waitMs must be .*; got an array/],
    [{ store: 'x'.repeat(100) }, 'store', /store must be 'redis' or 'memory'; got "x{80}…"\.$/],
    [{ contendedHttpStatus: 503 }, 'contendedHttpStatus', /contendedHttpStatus must be 409 \(Conflict\) or 423 \(Locked\); got 503/],
    [{ keyPrefix: 'app:}' }, 'keyPrefix', /without "\{" or "\}"/],
    [{ redis: { then: () => undefined } }, 'redis', /redis is an object of class Object that is not an ioredis client/],
    [{ replication: { replica: 1 } }, 'replica', /replication: unknown option "replica" \(did you mean "replicas"\?\)/],
    [
      { redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'], drift: 0.1 } },
      'drift',
      /redlock: unknown option "drift"\. Known options: clients, driftFactor/,
    ],
    [
      { redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'], driftFactor: NaN } },
      'redlock.driftFactor',
      /redlock\.driftFactor must be a number from 0 to below 0\.5 .*; got NaN/,
    ],
    [
      { redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'] }, replication: { replicas: 1 } },
      'replication',
      /replication \(WAIT\) works on one server or a Sentinel-managed master only; Redlock already needs a majority of masters/,
    ],
    [{ ttl: 1000 }, 'ttl', /unknown option "ttl"\. Known options: store, redis, keyPrefix/],
    [{ store: 'postgres' }, 'store', /store must be 'redis' or 'memory'; got "postgres"/],
    [{ stepTimeoutMs: 50 }, 'stepTimeoutMs', /stepTimeoutMs must be a whole number of milliseconds from 100 to 2147483647; got 50/],
    [{ stepTimeoutMs: Infinity }, 'stepTimeoutMs', /stepTimeoutMs must be .*; got Infinity/],
    [{ fencingCounterTtlMs: 500 }, 'fencingCounterTtlMs', /fencingCounterTtlMs must be a whole number of milliseconds from 1000 to 2147483647; got 500/],
    [{ fencingCounterTtlMs: Infinity }, 'fencingCounterTtlMs', /got Infinity/],
    [
      { redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'] }, fencingCounterTtlMs: 60_000 },
      'fencingCounterTtlMs',
      /redlock issues no fencing tokens, so its masters keep no fencing counters; leave fencingCounterTtlMs out/,
    ],
    [{ fencingTokens: 'no' }, 'fencingTokens', /fencingTokens must be true or false; got "no"/],
    [{ fencingTokens: false, fencingCounterTtlMs: 60_000 }, 'fencingCounterTtlMs', /fencingTokens is false, so grants keep no fencing counters; leave fencingCounterTtlMs out/],
    [
      { redlock: { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'] }, fencingTokens: true },
      'fencingTokens',
      /redlock issues no fencing tokens .*leave fencingTokens out/,
    ],
  ])('fails bootstrap on %j, naming %s', async (options, option, message) => {
    const failure = await bootstrapFailure(() => compile(options));
    expect(failure).toBeInstanceOf(LockConfigurationError);
    expect((failure as LockConfigurationError).option).toBe(option);
    expect((failure as Error).message).toMatch(message);
  });

  it('fails bootstrap with LockBackendError when Redis does not answer, and leaves nothing running', async () => {
    // Held for the whole test: a port that was merely free could be taken by another test's
    // redis-server meanwhile (which once made init succeed).
    const silent = await silentPort();
    try {
      const moduleRef = await Test.createTestingModule({
        imports: [LockModule.forRoot({ redis: `redis://127.0.0.1:${silent.port}`, connectTimeoutMs: 300 })],
      })
        .setLogger(new CapturingLogger())
        .compile();
      const failure = await bootstrapFailure(() => moduleRef.init());
      expect(failure).toBeInstanceOf(LockBackendError);
      expect((failure as Error).message).toMatch(/no answer from redis 127\.0\.0\.1:\d+ within 300 ms .*connectTimeoutMs: 0/);
      // Nothing left running: the service dropped its connection.
      await until(async () => silent.connections === 0, 5_000, 'the failed service kept its connection open');
    } finally {
      await silent.close();
    }
  });

  it('fails bootstrap as soon as the connection ends for good (retryStrategy gave up), saying so', async () => {
    const silent = await silentPort();
    try {
      const moduleRef = await Test.createTestingModule({
        imports: [LockModule.forRoot({ redis: { host: '127.0.0.1', port: silent.port, retryStrategy: () => null }, connectTimeoutMs: 30_000 })],
      })
        .setLogger(new CapturingLogger())
        .compile();
      const init = bootstrapFailure(() => moduleRef.init());
      await until(async () => silent.connections === 1, 5_000, 'never connected');
      await silent.close(); // the server goes away; the client gives up
      const failure = await within(init, 5_000);
      expect(failure).toBeInstanceOf(LockBackendError);
      expect((failure as Error).message).toMatch(/the connection to redis 127\.0\.0\.1:\d+ ended/);
    } finally {
      await silent.close();
    }
  });

  it('starts without checking Redis when connectTimeoutMs is 0', async () => {
    const port = await freePort();
    const moduleRef = await Test.createTestingModule({
      imports: [LockModule.forRoot({ redis: `redis://127.0.0.1:${port}`, connectTimeoutMs: 0 })],
    })
      .setLogger(new CapturingLogger())
      .compile();
    await moduleRef.init();
    await moduleRef.close();
  });

  it('opens no connection before bootstrap succeeds: a provider that fails to resolve leaves none behind', async () => {
    // Nest constructs LockService, then fails on a provider it cannot resolve: no lifecycle hook
    // runs, so a connection opened by the constructor would stay open, reconnecting for ever.
    @Injectable()
    class NeedsMissing {
      constructor(readonly missing: Map<string, string>) {}
    }
    const silent = await silentPort();
    try {
      const failure = await bootstrapFailure(() =>
        Test.createTestingModule({
          imports: [LockModule.forRoot({ redis: `redis://127.0.0.1:${silent.port}` })],
          providers: [NeedsMissing],
        })
          .setLogger(new CapturingLogger())
          .compile(),
      );
      expect((failure as Error).message).toMatch(/can't resolve dependencies of the NeedsMissing/);
      // A connection the service had started would reach the server before this one.
      const probe = connect(silent.port, '127.0.0.1');
      try {
        await until(async () => silent.connections > 0, 5_000, 'the probe connected');
        expect(silent.connections).toBe(1);
      } finally {
        probe.destroy();
      }
    } finally {
      await silent.close();
    }
  });

  it.each([
    ['a URL', 'at bootstrap, not when Nest constructs the service', (port: number) => `redis://127.0.0.1:${port}`, 0],
    ['ioredis options', 'at bootstrap, not when Nest constructs the service', (port: number) => ({ host: '127.0.0.1', port }), 0],
    ['Cluster startup nodes', 'at bootstrap, not when Nest constructs the service', (port: number) => ({ cluster: [{ host: '127.0.0.1', port }] }), 0],
    // The application's own choice wins: the README says lazyConnect: false connects them at once.
    ['ioredis options with lazyConnect: false', 'when Nest constructs the service', (port: number) => ({ host: '127.0.0.1', port, lazyConnect: false }), 1],
    ['Cluster startup nodes with lazyConnect: false', 'when Nest constructs the service', (port: number) => ({ cluster: [{ host: '127.0.0.1', port }], options: { lazyConnect: false } }), 1],
  ] as const)('connects its own connection given %s %s', async (_form, _when, given, atConstruction) => {
    const silent = await silentPort();
    const moduleRef = await Test.createTestingModule({ imports: [LockModule.forRoot({ redis: given(silent.port) as LockModuleOptions['redis'] })] })
      .setLogger(new CapturingLogger())
      .compile(); // providers constructed; no lifecycle hook has run
    const probe = connect(silent.port, '127.0.0.1');
    try {
      // A connection the service had started would reach the server before this one.
      await until(async () => silent.connections > atConstruction, 5_000, 'the probe connected');
      expect(silent.connections).toBe(atConstruction + 1);
    } finally {
      probe.destroy();
      await moduleRef.close();
      await silent.close();
    }
  });

  it('builds options with forRootAsync({ useFactory, inject, imports })', async () => {
    @Injectable()
    class Config {
      readonly url = redis.url;
    }
    @Module({ providers: [Config], exports: [Config] })
    class ConfigModule {}
    const moduleRef = await Test.createTestingModule({
      imports: [
        LockModule.forRootAsync({
          imports: [ConfigModule],
          inject: [Config],
          useFactory: async (config: Config) => ({ redis: config.url, keyPrefix: 'async:' }),
        }),
      ],
    }).compile();
    await moduleRef.init();
    const locks = moduleRef.get(LockService);
    await locks.run('f', async () => {
      expect(await redis.client().exists('async:{f}')).toBe(1);
    });
    await moduleRef.close();
  });

  it('builds options with forRootAsync({ useClass }) and ({ useExisting })', async () => {
    @Injectable()
    class LockConfig implements LockOptionsFactory {
      createLockOptions() {
        return { redis: redis.url, keyPrefix: 'class:' };
      }
    }
    @Module({ providers: [LockConfig], exports: [LockConfig] })
    class LockConfigModule {}
    for (const imports of [
      [LockModule.forRootAsync({ useClass: LockConfig })],
      [LockModule.forRootAsync({ imports: [LockConfigModule], useExisting: LockConfig })],
    ]) {
      const moduleRef = await Test.createTestingModule({ imports }).compile();
      await moduleRef.init();
      await moduleRef.get(LockService).run('c', async () => {
        expect(await redis.client().exists('class:{c}')).toBe(1);
      });
      await moduleRef.close();
    }
  });

  it('rejects forRootAsync without exactly one of useFactory, useClass, useExisting', () => {
    expect(() => LockModule.forRootAsync({})).toThrow(/exactly one of useFactory, useClass or useExisting; got 0/);
    class LockConfig implements LockOptionsFactory {
      createLockOptions() {
        return {};
      }
    }
    expect(() => LockModule.forRootAsync({ useFactory: () => ({}), useClass: LockConfig })).toThrow(
      /exactly one of useFactory, useClass or useExisting; got 2/,
    );
  });

  it('gives a forRootAsync factory the extraProviders it injects', async () => {
    const REDIS_URL = Symbol('REDIS_URL');
    const moduleRef = await Test.createTestingModule({
      imports: [
        LockModule.forRootAsync({
          extraProviders: [{ provide: REDIS_URL, useValue: redis.url }],
          inject: [REDIS_URL],
          useFactory: (url: string) => ({ redis: url, keyPrefix: 'extra:' }),
        }),
      ],
    }).compile();
    await moduleRef.init();
    await moduleRef.get(LockService).run('e', async () => {
      expect(await redis.client().exists('extra:{e}')).toBe(1);
    });
    await moduleRef.close();
  });

  it('fails bootstrap when forRootAsync produces bad options', async () => {
    const failure = await bootstrapFailure(() =>
      Test.createTestingModule({
        imports: [LockModule.forRootAsync({ useFactory: () => ({ waitMs: -1 }) })],
      })
        .setLogger(new CapturingLogger())
        .compile(),
    );
    expect(failure).toBeInstanceOf(LockConfigurationError);
  });

  /** A module that does not import LockModule, with a provider that injects LockService. */
  @Injectable()
  class Jobs {
    constructor(readonly locks: LockService) {}
  }
  @Module({ providers: [Jobs] })
  class JobsModule {}

  it('is injectable everywhere with isGlobal', async () => {
    const moduleRef = await Test.createTestingModule({
      imports: [LockModule.forRoot({ redis: redis.url, isGlobal: true }), JobsModule],
    }).compile();
    expect(moduleRef.get(Jobs).locks).toBe(moduleRef.get(LockService));
    await moduleRef.close();
  });

  it('is not global without isGlobal: a module that does not import LockModule cannot inject LockService', async () => {
    const failure = await bootstrapFailure(() =>
      Test.createTestingModule({ imports: [LockModule.forRoot({ redis: redis.url }), JobsModule] })
        .setLogger(new CapturingLogger())
        .compile(),
    );
    expect((failure as Error).message).toMatch(/can't resolve dependencies of the Jobs \(\?\)/);
  });

  it('releases held locks at shutdown, closes the client it created and completes events$ after the last loss', async () => {
    const moduleRef = await Test.createTestingModule({ imports: [LockModule.forRoot({ redis: redis.url })] })
      .setLogger(new CapturingLogger())
      .compile();
    await moduleRef.init();
    const locks = moduleRef.get(LockService);
    const lock = await locks.acquire('shutdown:1');
    const client = (locks as unknown as { store: { client: Redis } }).store.client;
    const seen: string[] = [];
    locks.events$.subscribe({
      next: (e) => seen.push(e.type === 'lost' ? `lost ${e.key} ${e.reason}` : e.type),
      complete: () => seen.push('complete'),
    });
    await moduleRef.close();
    expect(seen).toEqual(['lost shutdown:1 shutdown', 'complete']);
    expect(lock.signal.aborted).toBe(true);
    expect((lock.signal.reason as LockLostError).reason).toBe('shutdown');
    expect(await redis.client().exists('lock:{shutdown:1}')).toBe(0);
    expect(client.status).toBe('end');
    await expect(locks.acquire('shutdown:2')).rejects.toThrow(/the lock module has shut down/);
  });

  it("keeps locks held through the application's own onModuleDestroy and beforeApplicationShutdown hooks: work drained there finishes under its lock", async () => {
    const raw = redis.client();
    const started = gate();
    const finish = gate();
    let job: Promise<boolean> | undefined;
    let held: LockHandle | undefined;
    const looks: Record<string, { held: boolean; inRedis: number }> = {};
    const look = async () => ({ held: held!.isHeld, inRedis: await raw.exists('lock:{drain:job}') });
    @Injectable()
    class Worker implements OnModuleDestroy, BeforeApplicationShutdown {
      constructor(readonly locks: LockService) {}
      @Locked('drain:job')
      async work(): Promise<boolean> {
        held = this.locks.current();
        started.open();
        await finish.promise;
        return held!.signal.aborted;
      }
      async onModuleDestroy() {
        looks.onModuleDestroy = await look();
      }
      async beforeApplicationShutdown() {
        looks.beforeApplicationShutdown = await look();
        finish.open(); // the drain: let the running job finish, and wait for it
        await job;
      }
    }
    const moduleRef = await Test.createTestingModule({ imports: [LockModule.forRoot({ redis: redis.url })], providers: [Worker] })
      .setLogger(new CapturingLogger())
      .compile();
    await moduleRef.init();
    const locks = moduleRef.get(LockService);
    const events: string[] = [];
    locks.events$.subscribe((e) => e.key === 'drain:job' && events.push(e.type));
    job = moduleRef.get(Worker).work();
    await started.promise;
    await moduleRef.close();
    expect(looks).toEqual({ onModuleDestroy: { held: true, inRedis: 1 }, beforeApplicationShutdown: { held: true, inRedis: 1 } });
    expect(await job).toBe(false); // its signal never aborted
    expect(events).toEqual(['acquired', 'released']); // released by the job, not lost at shutdown
    expect(await raw.exists('lock:{drain:job}')).toBe(0);
  });

  it('releases held locks when a signal ends an application with enableShutdownHooks(), long before their lease', async () => {
    const child = new Fixture('shutdown-holder', [redis.url, 'shutdown:signal', '60000']);
    try {
      const { owner } = await child.next('holding');
      expect(await redis.client().hkeys('lock:{shutdown:signal}')).toEqual([owner]);
      child.kill('SIGTERM');
      // Nest closes the application, then raises the signal again: the process ends by it.
      expect(await child.exited).toEqual({ code: null, signal: 'SIGTERM' });
      expect(await redis.client().exists('lock:{shutdown:signal}')).toBe(0);
    } finally {
      await child.stop();
    }
  });

  it('never keeps a process alive by its locks: an application on the memory store that ends without close() exits, holding a lock', async () => {
    // The watchdog's timer, armed for the held lock's renewal (and left armed after a release), is unref'd.
    const child = new Fixture('memory-holder', []);
    try {
      expect(await child.next('holding')).toEqual({ type: 'holding', holdCount: 1 });
      let bound: NodeJS.Timeout | undefined;
      const stillRunning = new Promise((resolve) => (bound = setTimeout(() => resolve('still running 10 s after it ended'), 10_000)));
      expect(await Promise.race([child.exited, stillRunning]).finally(() => clearTimeout(bound))).toEqual({ code: 0, signal: null });
    } finally {
      await child.stop();
    }
  });

  it.each([
    ['a URL', (port: number) => `redis://127.0.0.1:${port}`],
    // A retry a minute away: the connections are surely between attempts, their sockets closed.
    ['ioredis options', (port: number) => ({ host: '127.0.0.1', port, retryStrategy: () => 60_000 })],
    // The application's client stays open; the subscriber is a copy of it, with its options.
    ['a client passed in', (port: number) => new Redis(port, '127.0.0.1', { retryStrategy: () => 60_000 })],
  ])('leaves no timer that keeps the process alive when close() follows an outage, on its own connections, given %s', async (_form, given) => {
    // ioredis 5 arms a timer of the connection's disconnectTimeout (2 s by default) at disconnect(),
    // cleared only by the socket's close, which a socket Redis already dropped never reports again:
    // a process that closes after an outage would stay up that long.
    const server = await RedisServer.start();
    const redisOption = given(server.port);
    const app = await startLockApp({ redis: redisOption });
    try {
      const held = await app.locks.acquire('outage:close');
      // Another owner's wait: the store subscribes to the release channel, on a connection of its own.
      await expect(app.locks.acquire('outage:close', { owner: 'another', waitMs: 50 })).rejects.toBeInstanceOf(LockNotAcquiredError);
      await held.release();
      await server.stop();
      await until(async () => (await app.locks.health(100)).status === 'down', 5_000, 'health down');
      const left = await timersLeftBy(() => app.close());
      expect(left.filter((ms) => ms >= 1_000)).toEqual([]);
    } finally {
      await app.close();
      if (redisOption instanceof Redis) redisOption.disconnect();
      await server.stop();
    }
  });

  it('wakes waiting acquisitions at shutdown (one key, several keys): they fail at once and leave the fair queue and the waiting writers first', async () => {
    const holder = await startLockApp({ redis: redis.url });
    const waiter = await startLockApp({ redis: redis.url });
    try {
      const fairLock = await holder.locks.acquire('shutdown:fair', { fair: true });
      const readLock = await holder.locks.readLock('shutdown:rw');
      const groupLock = await holder.locks.acquire('shutdown:g1');
      const contended = nextEvents(waiter.locks.events$, 'contended', 3);
      const settled: string[] = [];
      const waits = [
        waiter.locks.acquire('shutdown:fair', { fair: true, waitMs: 60_000 }),
        waiter.locks.writeLock('shutdown:rw', { waitMs: 60_000 }),
        waiter.locks.acquire(['shutdown:g1', 'shutdown:g2'], { waitMs: 60_000 }),
      ].map((p) => p.then(() => 'granted', (e: unknown) => (settled.push(String(e)), 'failed')));
      const owners = new Map((await contended).map((e) => [e.key, e.owner]));
      await waitRegistered(redis.client(), 'shutdown:fair', owners.get('shutdown:fair')!);
      expect(await redis.client().zscore('lock:{shutdown:rw}:writers', owners.get('shutdown:rw')!)).not.toBeNull();
      await waiter.close();
      // Every wait had failed by the time close() returned, and left nothing behind in Redis.
      expect(settled).toHaveLength(3);
      for (const failure of settled) expect(failure).toMatch(/^LockBackendError: Cannot acquire ".*": the lock module has shut down/);
      expect(await Promise.all(waits)).toEqual(['failed', 'failed', 'failed']);
      expect(await redis.client().exists('lock:{shutdown:g2}')).toBe(0);
      expect(await redis.client().exists('lock:{shutdown:fair}:queue', 'lock:{shutdown:fair}:queue:timeouts', 'lock:{shutdown:fair}:queue:leases', 'lock:{shutdown:rw}:writers')).toBe(0);
      await fairLock.release();
      await readLock.release();
      await groupLock.release();
    } finally {
      await waiter.close();
      await holder.close();
    }
  });

  it('wakes waits that carry a signal of their own at shutdown (one key, several keys): they fail at once', async () => {
    const holder = await startLockApp({ redis: redis.url });
    const waiter = await startLockApp({ redis: redis.url });
    try {
      const one = await holder.locks.acquire('shutdown:signal-one');
      const group = await holder.locks.acquire('shutdown:signal-g1');
      const client = redis.client();
      const before = await scriptCalls(client);
      const controller = new AbortController();
      const settled: string[] = [];
      const waits = [
        waiter.locks.acquire('shutdown:signal-one', { waitMs: 60_000, signal: controller.signal }),
        waiter.locks.acquire(['shutdown:signal-g1', 'shutdown:signal-g2'], { waitMs: 60_000, signal: controller.signal }),
      ].map((p) => p.then(() => 'granted', (e: unknown) => (settled.push(String(e)), 'failed')));
      // Both asleep: each made its first attempt, watched the key, and made its attempt after that.
      await until(async () => (await scriptCalls(client)) >= before + 4, 5_000, 'two attempts of each waiter');
      const closing = performance.now();
      await waiter.close();
      // At once: shutdown waits up to 2 s for acquisitions to end before it closes the connections,
      // which would end these waits too, but late.
      expect(performance.now() - closing).toBeLessThan(1_000);
      // Every wait had failed by the time close() returned, by shutdown (the caller's signal never aborted).
      expect(controller.signal.aborted).toBe(false);
      expect(settled).toHaveLength(2);
      for (const failure of settled) expect(failure).toMatch(/^LockBackendError: Cannot acquire ".*": the lock module has shut down/);
      expect(await Promise.all(waits)).toEqual(['failed', 'failed']);
      await one.release();
      await group.release();
    } finally {
      await waiter.close();
      await holder.close();
    }
  });

  /** 'granted', or the error an acquisition failed with, as a string. */
  const outcome = (acquisition: Promise<unknown>): Promise<string> =>
    acquisition.then(
      () => 'granted',
      (e: unknown) => String(e),
    );

  it('gives back a grant that arrives after shutdown began, for a lock and for a group, and fails that acquisition like any other then', async () => {
    const app = await startLockApp({ redis: redis.url });
    try {
      // Redis holds write commands for 300 ms: the attempt is in flight when close() starts.
      await redis.client().client('PAUSE', 300, 'WRITE');
      const acquiring = outcome(app.locks.acquire('shutdown:in-flight'));
      const group = outcome(app.locks.acquire(['shutdown:in-flight:a', 'shutdown:in-flight:b']));
      await app.close();
      expect(await acquiring).toMatch(/^LockBackendError: Cannot acquire "shutdown:in-flight": the lock module has shut down/);
      expect(await group).toMatch(/^LockBackendError: Cannot acquire "shutdown:in-flight:a, shutdown:in-flight:b": the lock module has shut down/);
      // Given back before the connection closed: nobody holds them until their lease would have ended.
      expect(await redis.client().exists('lock:{shutdown:in-flight}', 'lock:{shutdown:in-flight:a}', 'lock:{shutdown:in-flight:b}')).toBe(0);
    } finally {
      await app.close();
    }
  });

  it('shuts down while Redis does not answer: close() gives up on the releases instead of waiting for ever', async () => {
    const server = await RedisServer.start();
    const app = await startLockApp({ redis: server.url });
    try {
      const lock = await app.locks.acquire('shutdown:frozen');
      const contended = nextEvents(app.locks.events$, 'contended', 1);
      const waiting = outcome(app.locks.acquire('shutdown:frozen', { waitMs: 60_000 }));
      await contended;
      server.pause();
      // Without its bound, close() would wait for the release's reply, which never comes. It allows
      // 2 s for the releases and 1 s for the connection to quit; 15 s means it waits for ever.
      await expect(withTimeout(app.close(), 15_000, () => new Error('still closing after 15 s'))).resolves.toBeUndefined();
      expect((lock.signal.reason as LockLostError).reason).toBe('shutdown');
      expect(await waiting).toMatch(/^LockBackendError: Cannot acquire "shutdown:frozen": the lock module has shut down/);
      expect(server.running).toBe(true);
    } finally {
      server.resume();
      await app.close();
      await server.stop();
    }
  });

  it('never closes a client the application passed in, and leaves no listener on it', async () => {
    const own = new Redis(redis.url);
    try {
      await own.ping();
      const before = listenerCounts(own);
      const moduleRef = await Test.createTestingModule({ imports: [LockModule.forRoot({ redis: own })] }).compile();
      await moduleRef.init();
      await moduleRef.get(LockService).run('byo', async () => undefined);
      expect(listenerCounts(own)).not.toEqual(before); // the store listens while it runs
      await moduleRef.close();
      expect(listenerCounts(own)).toEqual(before);
      expect(await own.ping()).toBe('PONG');
    } finally {
      await own.quit();
    }
  });

  it('keeps two applications in one process apart: their locks contend', async () => {
    const make = async () => {
      const m = await Test.createTestingModule({ imports: [LockModule.forRoot({ redis: redis.url })] }).compile();
      await m.init();
      return m;
    };
    const [a, b] = await Promise.all([make(), make()]);
    const held = await a.get(LockService).acquire('apps:1');
    expect(await b.get(LockService).tryAcquire('apps:1')).toBeNull();
    await held.release();
    await Promise.all([a.close(), b.close()]);
  });
});

describe('LockModule on a Redis older than 6.2', () => {
  let redis: RedisServer;
  beforeAll(async () => {
    redis = await RedisServer.start();
  });
  afterAll(async () => {
    await redis?.stop();
  });

  it('fails bootstrap on Redis 6.1.16 (a proxy that claims it) with a LockConfigurationError that names the version and the one needed', async () => {
    const proxy = await olderRedisProxy(redis, '6.1.16');
    try {
      const failure = await bootstrapFailure(() => startLockApp({ redis: `redis://127.0.0.1:${proxy.port}` }));
      expect(failure).toBeInstanceOf(LockConfigurationError);
      expect((failure as Error).message).toMatch(new RegExp(`^redis 127\\.0\\.0\\.1:${proxy.port} runs Redis ${proxy.version.replace(/\./g, '\\.')}; nestjs-locked needs Redis 6\\.2 or later`));
    } finally {
      await proxy.close();
    }
  });

  it("fails bootstrap on a real Redis 6.0 (Debian 11's 6.0.16), where SET ... GET is a syntax error; unchecked, the first acquisition fails", async () => {
    // A real server where Debian has one. The 6.1 and 6.2 tests only claim their version through
    // a proxy: no Debian release ships either.
    const { server: old, version } = await olderRedis();
    try {
      expect(await serverIdentity(old.shared())).toBe(`Redis ${version}`);
      expect(version).toMatch(/^6\.0\./);
      await expect(old.shared().call('SET', 'k', 'v', 'GET')).rejects.toThrow('ERR syntax error');
      const failure = await bootstrapFailure(() => startLockApp({ redis: old.url }));
      expect(failure).toBeInstanceOf(LockConfigurationError);
      expect((failure as Error).message).toMatch(new RegExp(`^redis 127\\.0\\.0\\.1:${old.port} runs Redis ${version.replace(/\./g, '\\.')}; nestjs-locked needs Redis 6\\.2 or later`));
      expect(await old.shared().dbsize()).toBe(0);
      // Without the check (connectTimeoutMs: 0 starts without it), the first acquisition fails.
      const unchecked = await startLockApp({ redis: old.url, connectTimeoutMs: 0 });
      try {
        const error = await unchecked.locks.acquire('on-6.0').then(() => undefined, (e: unknown) => e);
        expect(error).toBeInstanceOf(LockBackendError);
        expect((error as Error).message).toMatch(/^Redis failed during acquire of "on-6\.0": ERR Error running script .*ERR syntax error/);
        expect(await old.shared().dbsize()).toBe(0);
      } finally {
        await unchecked.close();
      }
    } finally {
      await old.stop();
    }
  });

  it('starts on Redis 6.2, the first with SET ... GET, and takes locks there', async () => {
    const proxy = await olderRedisProxy(redis, '6.2.16');
    try {
      const app = await startLockApp({ redis: `redis://127.0.0.1:${proxy.port}` });
      try {
        await app.locks.run('on-6.2', async (lock) => expect(lock.fencingToken).toBeGreaterThan(0));
      } finally {
        await app.close();
      }
    } finally {
      await proxy.close();
    }
  });
});
