import type { Logger } from '@nestjs/common';
import { Cluster, Redis, type RedisOptions } from 'ioredis';
import { isRedisClient, type RedisClusterConnection, type RedisConnection, type ResolvedModuleOptions } from '../lock-options.js';
import type { LockStore } from './lock-store.js';
import { MemoryLockStore } from './memory/memory-lock.store.js';
import { RedisLockStore, type RedisClient } from './redis/redis-lock.store.js';
import { RedlockStore } from './redlock/redlock.store.js';

/**
 * ioredis arms a disconnectTimeout timer (2 s by default) on disconnect() that nothing clears when
 * the socket had already closed; keep it short on connections nestjs-locked owns.
 */
const OWNED_DISCONNECT_TIMEOUT_MS = 100;
/** The ioredis options of a connection nestjs-locked owns (see connect()). */
const OWNED_CONNECTION = { disconnectTimeout: OWNED_DISCONNECT_TIMEOUT_MS, lazyConnect: true };

/**
 * The store a LockService takes its locks in, as the module's options name it, and the connections
 * it goes on: the clients the application passed in, or connections of nestjs-locked's own (closed
 * by the store at shutdown), whose errors are logged once per message on `logger`.
 */
export function createStore(options: ResolvedModuleOptions, logger: Logger): LockStore {
  if (options.store === 'memory') return new MemoryLockStore();
  const connections = new Connections(options, logger);
  const log = {
    debug: (m: string) => logger.debug(m),
    warn: (m: string) => logger.warn(m),
  };
  const { redis, keyPrefix, replication, redlock, fencingCounterTtlMs, fencingTokens, stepTimeoutMs } = options;
  if (redlock) {
    const nodes = redlock.clients.map((connection) => {
      const { client, owned } = connections.forLocks(connection);
      // Redlock issues no fencing tokens: its nodes keep no counters.
      const store = new RedisLockStore(client as Redis, owned, keyPrefix, log, undefined, 0);
      return { name: store.description.replace(/^redis /, ''), store };
    });
    return new RedlockStore(nodes, redlock.driftFactor, stepTimeoutMs, log);
  }
  // resolveModuleOptions already refused replication with a Cluster, given as nodes or as a client.
  const { client, owned } = connections.forLocks(redis);
  return new RedisLockStore(client, owned, keyPrefix, log, replication, fencingCounterTtlMs, fencingTokens);
}

/** How the connections of one store are made. */
class Connections {
  constructor(
    private readonly options: ResolvedModuleOptions,
    private readonly logger: Logger,
  ) {}

  /**
   * The connection lock steps go on: the client the application passed in, or one made from its
   * options. Never one with ioredis's `commandTimeout`: ioredis then rejects a command it gave up on
   * while Redis may still run it, so an acquisition could leave a lock held that nobody knows of
   * (nestjs-locked bounds its steps itself and gives back what a step it gave up on took). A client
   * passed in with one is copied without it: a connection of nestjs-locked's own, closed at shutdown.
   */
  forLocks(connection: RedisConnection | RedisClient): { client: RedisClient; owned: boolean } {
    if (!isRedisClient(connection)) return { client: this.connect(connection), owned: true };
    const client = connection as RedisClient;
    const isCluster = (client as { isCluster?: boolean }).isCluster === true;
    const options: RedisOptions = isCluster ? ((client as Cluster).options.redisOptions ?? {}) : (client as Redis).options;
    const untimed = this.untimed(options, 'on a copy of the client passed in without it (one more connection, closed at shutdown)');
    if (untimed === options) return { client, owned: false };
    const copy = isCluster
      ? (client as Cluster).duplicate([], { lazyConnect: true, redisOptions: { ...untimed, disconnectTimeout: OWNED_DISCONNECT_TIMEOUT_MS } })
      : (client as Redis).duplicate({ ...untimed, ...OWNED_CONNECTION });
    return { client: this.watchErrors(copy), owned: true };
  }

  /** `options` without ioredis's commandTimeout (see forLocks), said once in the log; `options` itself when it has none. */
  private untimed<T extends { commandTimeout?: number }>(options: T | undefined, how: string): T | undefined {
    if (typeof options?.commandTimeout !== 'number') return options;
    this.logger.log(
      `ioredis commandTimeout (${options.commandTimeout} ms): ioredis gives up on a command that Redis may still run, which for an acquisition would leave a lock held that nobody knows of; ` +
        `nestjs-locked bounds its lock steps itself, by stepTimeoutMs (${this.options.stepTimeoutMs} ms; an attempt by its wait, at least that), and gives back what a step it gave up on took. Lock steps run ${how}.`,
    );
    return { ...options, commandTimeout: undefined };
  }

  /**
   * A connection nestjs-locked owns (closed at shutdown), with its errors logged once per message.
   * It connects at bootstrap (LockService.onModuleInit: the check, or with connectTimeoutMs: 0 a
   * connect that is not waited for), not when the service is constructed: Nest constructs providers
   * before it has resolved them all, and when another provider then fails to resolve, no lifecycle
   * hook ever runs to close a connection opened here, which would keep the process alive reconnecting.
   */
  private connect(redis: RedisConnection): RedisClient {
    let client: RedisClient;
    if (typeof redis === 'string') client = new Redis(redis, OWNED_CONNECTION);
    else if ('cluster' in redis) {
      const { cluster, options } = redis as RedisClusterConnection;
      client = new Cluster(cluster, { lazyConnect: true, ...options, redisOptions: { disconnectTimeout: OWNED_DISCONNECT_TIMEOUT_MS, ...this.untimed(options?.redisOptions, 'without it') } });
    } else client = new Redis({ ...OWNED_CONNECTION, ...this.untimed(redis as RedisOptions, 'without it') });
    return this.watchErrors(client);
  }

  /** Logs a connection's errors once per message (until it is ready again). */
  private watchErrors(client: RedisClient): RedisClient {
    let lastError = '';
    client.on('error', (e: Error) => {
      if (e.message !== lastError) this.logger.warn(`Redis connection: ${e.message}`);
      lastError = e.message;
    });
    client.on('ready', () => (lastError = ''));
    return client;
  }
}
