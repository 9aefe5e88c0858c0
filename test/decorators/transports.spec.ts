import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Controller, Module, type INestApplication, type INestMicroservice } from '@nestjs/common';
import { NestFactory } from '@nestjs/core';
import { ClientProxyFactory, EventPattern, MessagePattern, Payload, Transport, type ClientProxy } from '@nestjs/microservices';
import { MessageBody, SubscribeMessage, WebSocketGateway } from '@nestjs/websockets';
import { firstValueFrom } from 'rxjs';
import { io, type Socket } from 'socket.io-client';
import { Locked, LockModule, LockService } from '../../lib/index.js';
import { CapturingLogger, gate, listening, loggedUnavailable, nextEvent } from '../support/lock-testing.js';
import { freePort, RedisServer } from '../support/redis-server.js';

const handled: string[] = [];
const eventHandled = gate<string>();

@Controller()
class OrdersHandlers {
  constructor(private readonly locks: LockService) {}

  // @Locked above the pattern decorator
  @Locked('order:<0.id>', { onContention: 'fail' })
  @MessagePattern('order.reserve')
  async reserve(@Payload() order: { id: number }) {
    handled.push(`reserve:${order.id}`);
    return { key: this.locks.current()?.key, holdCount: this.locks.current()?.holdCount };
  }

  // No parameter decorators: Nest passes the raw message, which @Locked must not take away.
  @MessagePattern('order.raw')
  @Locked('order:<0.id>', { onContention: 'fail' })
  async raw(order: { id: number }) {
    return { key: this.locks.current()?.key, id: order.id };
  }

  // @Locked below the pattern decorator
  @EventPattern('order.shipped')
  @Locked('order:<0.id>')
  async shipped(@Payload() order: { id: number }) {
    eventHandled.open(this.locks.current()?.key ?? 'no lock');
  }
}

@WebSocketGateway({ cors: true })
class ChatGateway {
  constructor(private readonly locks: LockService) {}

  @SubscribeMessage('edit')
  @Locked('doc:<0.doc>', { onContention: 'fail' })
  async edit(@MessageBody() body: { doc: string }) {
    return { event: 'edited', data: { key: this.locks.current()?.key } };
  }

  // No parameter decorators: Nest passes the raw (client, data).
  @SubscribeMessage('rename')
  @Locked((_client: unknown, body: { doc: string }) => `doc:${body.doc}`, { onContention: 'fail' })
  async rename(client: unknown, body: { doc: string }) {
    return { event: 'renamed', data: { key: this.locks.current()?.key, client: typeof client, doc: body.doc } };
  }
}

describe('@Locked on microservice handlers (TCP)', () => {
  let redis: RedisServer;
  let service: INestMicroservice;
  let client: ClientProxy;
  let locks: LockService;
  let logger: CapturingLogger;
  beforeAll(async () => {
    redis = await RedisServer.start();
    @Module({ imports: [LockModule.forRoot({ redis: redis.url, isGlobal: true })], controllers: [OrdersHandlers] })
    class OrdersModule {}
    // A port probed free can be taken by another test's server before Nest binds it: then try another.
    let port = 0;
    for (let attempt = 0; ; attempt++) {
      port = await freePort();
      logger = new CapturingLogger();
      service = await NestFactory.createMicroservice(OrdersModule, {
        transport: Transport.TCP,
        options: { host: '127.0.0.1', port },
        logger,
      });
      try {
        await service.listen();
        break;
      } catch (error) {
        await service.close();
        if (attempt >= 4 || (error as { code?: string }).code !== 'EADDRINUSE') throw error;
      }
    }
    locks = service.get(LockService);
    client = ClientProxyFactory.create({ transport: Transport.TCP, options: { host: '127.0.0.1', port } });
    await client.connect();
  });
  afterAll(async () => {
    await client?.close();
    await service?.close();
    await redis?.stop();
  });

  it('locks a @MessagePattern handler on the key from its payload', async () => {
    expect(await firstValueFrom(client.send('order.reserve', { id: 4 }))).toEqual({ key: 'order:4', holdCount: 1 });
  });

  it('answers contention with an RpcException the client receives as an error object', async () => {
    const holder = await locks.acquire('order:5', { leaseMs: 5_000 });
    const failure = await firstValueFrom(client.send('order.reserve', { id: 5 })).catch((e: unknown) => e);
    expect(failure).toMatchObject({ status: 'error', code: 'LOCK_NOT_ACQUIRED', key: 'order:5' });
    expect((failure as { retryAfterMs: number }).retryAfterMs).toBeGreaterThan(4_000);
    expect(handled).not.toContain('reserve:5');
    await holder.release();
  });

  it('leaves a handler without parameter decorators its raw arguments, and still answers contention with an RpcException', async () => {
    expect(await firstValueFrom(client.send('order.raw', { id: 7 }))).toEqual({ key: 'order:7', id: 7 });
    const holder = await locks.acquire('order:8', { leaseMs: 5_000 });
    const failure = await firstValueFrom(client.send('order.raw', { id: 8 })).catch((e: unknown) => e);
    expect(failure).toMatchObject({ status: 'error', code: 'LOCK_NOT_ACQUIRED', key: 'order:8' });
    await holder.release();
  });

  it('locks an @EventPattern handler', async () => {
    const acquired = nextEvent(locks.events$, 'acquired', (e) => e.key === 'order:6');
    await firstValueFrom(client.emit('order.shipped', { id: 6 }));
    expect(await eventHandled.promise).toBe('order:6');
    await acquired;
  });

  it('answers LOCK_UNAVAILABLE when Redis does not answer', async () => {
    redis.pause();
    try {
      const failure = await firstValueFrom(client.send('order.reserve', { id: 10 })).catch((e: unknown) => e);
      expect(failure).toMatchObject({ status: 'error', code: 'LOCK_UNAVAILABLE', key: 'order:10' });
      // The error object does not pass on the cause (which may name servers); the log has it.
      expect(JSON.stringify(failure)).not.toMatch(/no answer/);
      expect(loggedUnavailable(logger, 'order:10')).toBe(true);
      expect(handled).not.toContain('reserve:10');
    } finally {
      redis.resume();
    }
  });
});

describe('@Locked on WebSocket gateway handlers (socket.io)', () => {
  let redis: RedisServer;
  let app: INestApplication;
  let socket: Socket;
  let locks: LockService;
  let logger: CapturingLogger;
  beforeAll(async () => {
    redis = await RedisServer.start();
    @Module({ imports: [LockModule.forRoot({ redis: redis.url, isGlobal: true })], providers: [ChatGateway] })
    class ChatModule {}
    logger = new CapturingLogger();
    app = await NestFactory.create(ChatModule, { logger });
    const url = await listening(app);
    locks = app.get(LockService);
    socket = io(url, { transports: ['websocket'], reconnection: false });
    await new Promise<void>((resolve, reject) => {
      socket.once('connect', () => resolve());
      socket.once('connect_error', reject);
    });
  });
  afterAll(async () => {
    socket?.disconnect();
    await app?.close();
    await redis?.stop();
  });

  it('locks a @SubscribeMessage handler on the key from its message', async () => {
    const reply = new Promise((resolve) => socket.once('edited', resolve));
    socket.emit('edit', { doc: 'readme' });
    expect(await reply).toEqual({ key: 'doc:readme' });
  });

  it('answers contention with a WsException the client receives as an "exception" event', async () => {
    const holder = await locks.acquire('doc:spec');
    const exception = new Promise((resolve) => socket.once('exception', resolve));
    socket.emit('edit', { doc: 'spec' });
    expect(await exception).toMatchObject({ status: 'error', code: 'LOCK_NOT_ACQUIRED', key: 'doc:spec' });
    await holder.release();
  });

  it('leaves a handler without parameter decorators its raw (client, data), and still answers contention with a WsException', async () => {
    const reply = new Promise((resolve) => socket.once('renamed', resolve));
    socket.emit('rename', { doc: 'notes' });
    expect(await reply).toEqual({ key: 'doc:notes', client: 'object', doc: 'notes' });
    const holder = await locks.acquire('doc:busy');
    const exception = new Promise((resolve) => socket.once('exception', resolve));
    socket.emit('rename', { doc: 'busy' });
    expect(await exception).toMatchObject({ status: 'error', code: 'LOCK_NOT_ACQUIRED', key: 'doc:busy' });
    await holder.release();
  });

  it('answers LOCK_UNAVAILABLE with a WsException when Redis does not answer', async () => {
    redis.pause();
    try {
      const exception = new Promise((resolve) => socket.once('exception', resolve));
      socket.emit('edit', { doc: 'down' });
      const received = await exception;
      expect(received).toMatchObject({ status: 'error', code: 'LOCK_UNAVAILABLE', key: 'doc:down' });
      expect(JSON.stringify(received)).not.toMatch(/no answer/);
      expect(loggedUnavailable(logger, 'doc:down')).toBe(true);
    } finally {
      redis.resume();
    }
  });
});
