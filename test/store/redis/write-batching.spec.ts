import { afterAll, beforeAll, describe, expect, it, jest } from '@jest/globals';
import type { Redis } from 'ioredis';
import type { LockHandle } from '../../../lib/index.js';
import { batchWrites, COMMANDS_PER_WRITE } from '../../../lib/store/redis/write-batching.js';
import { asleep, elsewhere, startLockApp, usePrivateLockApp, within, type LockApp } from '../../support/lock-testing.js';
import { RedisServer, until } from '../../support/redis-server.js';

/** How many times Redis has read from its clients' sockets (INFO stats). */
async function readsProcessed(admin: Redis): Promise<number> {
  const info = await admin.info('stats');
  return Number(/total_reads_processed:(\d+)/.exec(info)![1]);
}

/**
 * Redis's reads of the lock connection while `send` runs: the INFO after it is one read of its own
 * (the admin connection is otherwise idle, and nothing else talks to this server).
 */
async function readsDuring(admin: Redis, send: () => Promise<unknown>): Promise<number> {
  const before = await readsProcessed(admin);
  await send();
  return (await readsProcessed(admin)) - before - 1;
}

/**
 * At most how many socket writes `count` commands started in one pass of the event loop take: the
 * first goes out at once (its connection had nothing in flight), the other count - 1 in writes of
 * COMMANDS_PER_WRITE.
 */
const writesFor = (count: number): number => 1 + Math.ceil((count - 1) / COMMANDS_PER_WRITE);

/**
 * Watches `client`'s socket writes (each one system call): how many commands each carried, in
 * order. ioredis writes each command as one chunk.
 */
function watchWrites(client: Redis): number[] {
  const stream = client.stream as unknown as {
    _write(chunk: unknown, encoding: string, done: () => void): void;
    _writev(chunks: unknown[], done: () => void): void;
  };
  const writes: number[] = [];
  const write = stream._write.bind(stream);
  const writev = stream._writev.bind(stream);
  stream._write = (chunk, encoding, done) => (writes.push(1), write(chunk, encoding, done));
  stream._writev = (chunks, done) => (writes.push(chunks.length), writev(chunks, done));
  return writes;
}

describe('write batching on the lock connection', () => {
  let redis: RedisServer;
  let app: LockApp;
  let admin: Redis;
  usePrivateLockApp({}, (started) => ({ redis, raw: admin, app } = started));

  it('sends the locks taken and released in one pass of the event loop in one socket write per 8 commands', async () => {
    const count = 4 * COMMANDS_PER_WRITE;
    const keys = Array.from({ length: count }, (_, i) => `batch:${i}`);
    let handles: LockHandle[] = [];
    // Started in one pass of the event loop, one command per key: written one by one, Redis would
    // read each on its own (up to `count` reads). Batched: see writesFor.
    const writes = writesFor(count);
    const acquireReads = await readsDuring(admin, async () => (handles = await Promise.all(keys.map((key) => app.locks.acquire(key, { waitMs: 0 })))));
    expect(handles.map((h) => h.key)).toEqual(keys);
    expect(acquireReads).toBeGreaterThanOrEqual(1);
    expect(acquireReads).toBeLessThanOrEqual(writes);
    const releaseReads = await readsDuring(admin, () => Promise.all(handles.map((h) => h.release())));
    expect(releaseReads).toBeLessThanOrEqual(writes);
    expect(await admin.exists(...keys.map((key) => `lock:{${key}}`))).toBe(0);
  });

  /**
   * Two commands sent in one pass on an idle connection, the first with batchWrites(client,
   * `withNext`): whether the socket was corked after each, and that both were answered and uncorked.
   */
  async function corkedAfterEach(withNext: boolean): Promise<[number, number]> {
    const client = redis.client();
    try {
      await client.ping();
      const stream = client.stream as unknown as { writableCorked: number };
      batchWrites(client, withNext);
      const first = client.get('first');
      const afterFirst = stream.writableCorked;
      batchWrites(client);
      const second = client.get('second');
      const afterSecond = stream.writableCorked;
      expect(await Promise.all([first, second])).toEqual([null, null]);
      expect(stream.writableCorked).toBe(0);
      return [afterFirst, afterSecond];
    } finally {
      client.disconnect();
    }
  }

  it('writes a command at once when its connection has nothing in flight, and corks the ones sent after it', async () => {
    // One caller on its own: nothing to batch with, so it does not wait for the immediate. The next
    // command of the same pass finds the first in flight: it waits for the batch.
    expect(await corkedAfterEach(false)).toEqual([0, 1]);
  });

  it('corks a command on an idle connection when more are to follow in the same write (a release and the waiter it takes along)', async () => {
    expect(await corkedAfterEach(true)).toEqual([1, 1]);
  });

  it('sends the commands after the first of a pass in socket writes of 8, the last write taking the rest', async () => {
    const client = redis.client();
    try {
      await client.ping();
      const writes = watchWrites(client);
      const replies = Array.from({ length: 32 }, (_, i) => {
        batchWrites(client);
        return client.get(`per-write:${i}`);
      });
      expect(await Promise.all(replies)).toEqual(Array.from({ length: 32 }, () => null));
      // The first at once (nothing in flight), then 31 in writes of 8: 8, 8, 8 and the last 7.
      expect(writes).toEqual([1, 8, 8, 8, 7]);
    } finally {
      client.disconnect();
    }
  });

  it('sends a release and the attempt of the waiter it takes along in one socket write, on an idle connection', async () => {
    // A multi-key waiter sends its own attempt when woken (a single-key one is handed the lock
    // inside the release, with nothing more to send).
    const holder = await app.locks.acquire('along');
    const waiting = elsewhere(() => app.locks.acquire(['along', 'along:other'], { waitMs: 10_000 }));
    await until(async () => asleep(app, 'along') === 1, 10_000, 'the waiter asleep');
    const client = (app.locks as unknown as { store: { client: Redis } }).store.client;
    const writes = watchWrites(client);
    await holder.release();
    const next = await waiting;
    expect(next.owner).not.toBe(holder.owner);
    // Not corked, the release (its connection idle) would be written at once, the attempt after it.
    expect(writes).toEqual([2]);
    await next.release();
  });

  it("sends its commands under Jest's fake timers too (they replace the global setImmediate)", async () => {
    // A command held back would never be answered: `within` bounds each step by Node's own timer.
    jest.useFakeTimers();
    try {
      const handle = await within(app.locks.acquire('faked', { waitMs: 0 }), 5_000);
      expect(await admin.exists('lock:{faked}')).toBe(1);
      await within(handle.release(), 5_000);
      expect(await admin.exists('lock:{faked}')).toBe(0);
      // Several at once: the first is written at once, the others are corked until the immediate.
      const keys = ['faked:1', 'faked:2', 'faked:3'];
      const handles = await within(Promise.all(keys.map((key) => app.locks.acquire(key, { waitMs: 0 }))), 5_000);
      expect(await admin.exists(...keys.map((key) => `lock:{${key}}`))).toBe(3);
      await within(Promise.all(handles.map((h) => h.release())), 5_000);
      expect(await admin.exists(...keys.map((key) => `lock:{${key}}`))).toBe(0);
    } finally {
      jest.useRealTimers();
    }
  });

  it('keeps the order of the commands of a shared connection', async () => {
    const client = redis.client();
    const shared = await startLockApp({ redis: client });
    try {
      // In one turn: the application's writes around the lock's own commands, on one socket.
      const [, handle, , value] = await Promise.all([client.set('seq', 'before'), shared.locks.acquire('seq-lock'), client.set('seq', 'after'), client.get('seq')]);
      expect(value).toBe('after');
      expect(await admin.hgetall('lock:{seq-lock}')).toEqual({ [handle.owner]: '1' });
      await handle.release();
    } finally {
      await shared.close();
    }
  });
});

describe('write batching under Redlock', () => {
  let nodes: RedisServer[] = [];
  let app: LockApp;
  beforeAll(async () => {
    nodes = await Promise.all([0, 1, 2].map(() => RedisServer.start()));
    app = await startLockApp({ redlock: { clients: nodes.map((n) => n.url) } });
  });
  afterAll(async () => {
    await app?.close();
    await Promise.all(nodes.map((n) => n.stop()));
  });

  it("batches each node's connection on its own", async () => {
    const count = 4 * COMMANDS_PER_WRITE;
    const keys = Array.from({ length: count }, (_, i) => `redlock-batch:${i}`);
    const admins = nodes.map((n) => n.client());
    const before = await Promise.all(admins.map(readsProcessed));
    const handles = await Promise.all(keys.map((key) => app.locks.acquire(key, { waitMs: 0 })));
    const after = await Promise.all(admins.map(readsProcessed));
    // Each node: its reads of the lock connection, less the second INFO's own read.
    for (const [i, reads] of after.entries()) expect(reads - before[i]! - 1).toBeLessThanOrEqual(writesFor(count));
    await Promise.all(handles.map((h) => h.release()));
  });
});
