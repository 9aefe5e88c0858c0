import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import type { Redis } from 'ioredis';
import { LockBackendError } from '../../lib/index.js';
import { bootstrapFailure, startLockApp, wokenBy } from '../support/lock-testing.js';
import { RedisCluster } from '../support/redis-cluster.js';
import { freePort, RedisServer } from '../support/redis-server.js';
import { repoRoot } from '../support/paths.js';

/** A self-signed certificate for 127.0.0.1, made for these tests only (valid until 2126). */
const tlsDir = join(repoRoot, 'test', 'fixtures', 'tls');
const ca = readFileSync(join(tlsDir, 'cert.pem'));
/** redis-server's TLS arguments, on `port`; clients are not asked for a certificate. */
const tlsArgs = (port: number) => [
  '--tls-port', String(port),
  '--tls-cert-file', join(tlsDir, 'cert.pem'),
  '--tls-key-file', join(tlsDir, 'key.pem'),
  '--tls-ca-cert-file', join(tlsDir, 'cert.pem'),
  '--tls-auth-clients', 'no',
];
/** How many connections `server` has on `port` (Redis lists each client's local address). */
const connectionsOn = async (server: Redis, port: number) => String(await server.client('LIST')).split('\n').filter((line) => line.includes(` laddr=127.0.0.1:${port} `)).length;

describe('Redis over TLS', () => {
  let redis: RedisServer;
  let raw: Redis;
  let tlsPort: number;
  beforeAll(async () => {
    // The plain port stays, for the test's own inspection; the apps use the TLS port only.
    redis = await RedisServer.start(async () => tlsArgs((tlsPort = await freePort())));
    raw = redis.client();
  });
  afterAll(async () => {
    await redis?.stop();
  });

  /** The connections made to the TLS port. */
  const overTls = () => connectionsOn(raw, tlsPort);

  it('locks, and wakes a waiter of another application by the release message, with ioredis tls options (the subscriber connection too)', async () => {
    const options = { redis: { host: '127.0.0.1', port: tlsPort, tls: { ca } }, leaseMs: 60_000 };
    const holders = await startLockApp(options);
    const waiters = await startLockApp(options);
    try {
      const holder = await holders.locks.acquire('tls:woken', { leaseMs: 120_000 });
      // Within 5 s of the release, with a 120 s lease: only the release message wakes the waiter.
      await wokenBy(() => holder.release(), waiters, 'tls:woken', 5_000);
      // Each application's connection, and the waiter's subscriber connection (kept for the app's life).
      expect(await overTls()).toBe(3);
      expect(await raw.exists('lock:{tls:woken}')).toBe(0);
    } finally {
      await holders.close();
      await waiters.close();
    }
  });

  it('takes a rediss:// URL as TLS with the certificate checked: bootstrap fails with LockBackendError on a certificate Node does not trust', async () => {
    const failure = await bootstrapFailure(() => startLockApp({ redis: `rediss://127.0.0.1:${tlsPort}`, connectTimeoutMs: 2_000 }));
    expect(failure).toBeInstanceOf(LockBackendError);
    expect((failure as Error).message).toMatch(/self-signed certificate/);
  });

  // The scheme is case-insensitive; ioredis takes only a lower-case "rediss://" as TLS and connects
  // to "REDISS://" in plain text (password included), which this TLS port would never answer.
  it.each(['REDISS', 'Rediss'])('takes a %s:// URL as TLS too: the certificate is checked as for rediss://', async (scheme) => {
    const failure = await bootstrapFailure(() => startLockApp({ redis: `${scheme}://127.0.0.1:${tlsPort}`, connectTimeoutMs: 2_000 }));
    expect(failure).toBeInstanceOf(LockBackendError);
    expect((failure as Error).message).toMatch(/self-signed certificate/);
  });

  // A socket ended during its TLS handshake can report two errors: the certificate Node refuses,
  // then the server's alert (decode_error) to the handshake cut short. ioredis listens for the
  // first only; the second, unheard, was an uncaught exception (it failed this file's previous
  // test about one run in ten, when the bootstrap deadline fell mid-handshake). About two closes
  // in five at this moment get the second error, so twenty make it all but certain.
  it('closes an application whose connection is mid-TLS-handshake without an uncaught socket error', async () => {
    for (let i = 0; i < 20; i++) {
      const app = await startLockApp({ redis: `rediss://127.0.0.1:${tlsPort}`, connectTimeoutMs: 0 });
      const client = (app.locks as unknown as { store: { client: Redis } }).store.client;
      // ioredis makes its socket a tick or two after connect(), with no event to say so.
      for (let turn = 0; turn < 100 && !client.stream; turn++) await new Promise(setImmediate);
      const stream = client.stream;
      // TCP is up and, on loopback most often, the TLS handshake not done yet: close() ends the socket now.
      if (stream?.connecting) await new Promise((resolve) => stream.once('connect', resolve));
      // Not events.once(): the certificate error, when it comes first, is the client's 'error' event.
      const ended = new Promise((resolve) => client.once('end', resolve));
      await app.close();
      // ioredis ends the client when the socket has closed; the second error, when it comes, comes before.
      await ended;
    }
  });
});

describe('Redis Cluster over TLS', () => {
  let cluster: RedisCluster;
  /** Each node's TLS port, by the index of its server in `cluster.servers`. */
  const tlsPorts: number[] = [];
  beforeAll(async () => {
    // Each node keeps its plain port for the test's own inspection and for creating the cluster;
    // with tls-cluster, the bus is TLS too, and a node names its TLS port to clients that use TLS.
    cluster = await RedisCluster.start(3, 0, async (node) => {
      tlsPorts[node] = await freePort();
      return [...tlsArgs(tlsPorts[node]), '--tls-cluster', 'yes'];
    });
  });
  afterAll(async () => {
    await cluster?.stop();
  });

  it('locks, and wakes a waiter of another application by the sharded release message, every connection on the TLS ports', async () => {
    const plainPorts = cluster.servers.map((server) => server.port);
    const counts = (ports: number[]) => Promise.all(cluster.servers.map((server, i) => connectionsOn(cluster.node(server), ports[i]!)));
    const plainBefore = await counts(plainPorts);
    const options = {
      redis: { cluster: tlsPorts.map((port) => ({ host: '127.0.0.1', port })), options: { redisOptions: { tls: { ca } } } },
      leaseMs: 60_000,
    };
    const holders = await startLockApp(options);
    const waiters = await startLockApp(options);
    try {
      const holder = await holders.locks.acquire('tls:cluster', { leaseMs: 120_000 });
      // Within 5 s of the release, with a 120 s lease: only the release message wakes the waiter.
      await wokenBy(
        async () => {
          // The waiter sleeps on one sharded subscription (SSUBSCRIBE), made on a TLS port.
          const subscribers = await Promise.all(
            cluster.servers.map(async (server, i) =>
              String(await cluster.node(server).client('LIST'))
                .split('\n')
                .filter((line) => / ssub=[1-9]/.test(line))
                .map((line) => (line.includes(` laddr=127.0.0.1:${tlsPorts[i]} `) ? 'tls' : 'plain')),
            ),
          );
          expect(subscribers.flat()).toEqual(['tls']);
          await holder.release();
        },
        waiters,
        'tls:cluster',
        5_000,
      );
      // No connection of either application reached a plain port; the lock's scripts ran on a TLS one.
      expect(await counts(plainPorts)).toEqual(plainBefore);
      const slot = Number(await cluster.node(cluster.servers[0]!).cluster('KEYSLOT', 'lock:{tls:cluster}'));
      const owner = await cluster.ownerOf(slot);
      expect(await connectionsOn(cluster.node(owner), tlsPorts[cluster.servers.indexOf(owner)]!)).toBeGreaterThanOrEqual(2);
    } finally {
      await holders.close();
      await waiters.close();
    }
  });
});
