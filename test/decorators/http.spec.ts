import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import {
  applyDecorators,
  Body,
  Catch,
  Controller,
  HttpException,
  type ArgumentsHost,
  type ExceptionFilter,
  Get,
  Injectable,
  Module,
  NotFoundException,
  Param,
  ParseIntPipe,
  Post,
  Res,
  Sse,
  StreamableFile,
  type CanActivate,
  type ExecutionContext,
  type INestApplication,
  type PipeTransform,
} from '@nestjs/common';
import { APP_INTERCEPTOR, NestFactory } from '@nestjs/core';
import { FastifyAdapter } from '@nestjs/platform-fastify';
import { PassThrough } from 'node:stream';
import { from, interval, map, mergeMap, Observable } from 'rxjs';
import { LockBackendError, Locked, LockInterceptor, LockModule, LockNotAcquiredError, LockService } from '../../lib/index.js';
import { translateLockError } from '../../lib/lock.interceptor.js';
import { CapturingLogger, gate, listening, loggedUnavailable, nextEvent, within } from '../support/lock-testing.js';
import { RedisServer } from '../support/redis-server.js';

class TransferDto {
  constructor(
    readonly from: string,
    readonly to: string,
  ) {}
}
/** A transforming pipe: the handler receives a TransferDto built from the raw body. */
class ToTransfer implements PipeTransform {
  transform(body: { source: string; target: string }) {
    return new TransferDto(body.source.toUpperCase(), body.target.toUpperCase());
  }
}

/** Drops the parameter types TypeScript recorded, as a compiler that emits no decorator metadata would. */
function WithoutParamTypes(): MethodDecorator {
  return (target, key) => {
    Reflect.deleteMetadata('design:paramtypes', target, key);
  };
}

const holding = new Map<string, { entered: () => void; release: Promise<void> }>();

/** A global guard that notes the handler names Nest shows it, as rate limiters and loggers read them. */
class HandlerNames implements CanActivate {
  readonly seen: string[] = [];
  canActivate(context: ExecutionContext): boolean {
    this.seen.push(`${context.getClass().name}.${context.getHandler().name}`);
    return true;
  }
}
/** The bodies of `download`, which the test ends. */
const downloads = new Map<string, PassThrough>();

@Injectable()
class Inventory {
  constructor(readonly locks: LockService) {}

  @Locked('item:<0>')
  async reserve(id: number) {
    return { holdCount: this.locks.current()?.holdCount, key: this.locks.current()?.key };
  }
}

/**
 * A project's own decorators that compose a route and its lock with applyDecorators, which applies
 * them first to last: the later one is the outer, as the upper one of two stacked decorators.
 */
const LockedGet = (path: string, key: string) => applyDecorators(Get(path), Locked(key));
const GetLocked = (path: string, key: string) => applyDecorators(Locked(key), Get(path));

@Controller('items')
class ItemsController {
  constructor(
    private readonly inventory: Inventory,
    private readonly locks: LockService,
  ) {}

  // @Locked below the route decorator
  @Get(':id')
  @Locked('item:<0>')
  async get(@Param('id', ParseIntPipe) id: number) {
    const wait = holding.get(`item:${id}`);
    if (wait) {
      wait.entered();
      await wait.release;
    }
    return { id, key: this.locks.current()?.key, nested: await this.inventory.reserve(id) };
  }

  // @Locked above the route decorator
  @Locked('transfer:<0.from>:<0.to>')
  @Post('transfer')
  async transfer(@Body(new ToTransfer()) dto: TransferDto) {
    return { key: this.locks.current()?.key };
  }

  // Holds while the test says (see `holding`), and takes no other lock.
  @Get(':id/held')
  @Locked('item:<0>')
  async held(@Param('id') id: string) {
    const wait = holding.get(`item:${id}`);
    if (wait) {
      wait.entered();
      await wait.release;
    }
    return { id };
  }

  @Get(':id/missing')
  @Locked('item:<0>')
  async missing(@Param('id') id: string) {
    throw new NotFoundException(`item ${id} does not exist`);
  }

  @Locked('item:<0>', { onContention: 'fail' })
  @Get(':id/fail')
  async failFast(@Param('id') id: string) {
    return { id };
  }

  @Locked('item:<0>', { onContention: 'skip' })
  @Get(':id/skip')
  async skipping(@Param('id') id: string) {
    return { id };
  }

  // No parameters; @Locked above the route decorator: Nest passes the call site, no interceptor.
  @Locked('items:all')
  @Get('all/above')
  async listAbove() {
    return { key: this.locks.current()?.key };
  }

  // No parameters; @Locked below the route decorator: the interceptor translates instead.
  @Get('all/below')
  @Locked('items:all')
  async listBelow() {
    return { key: this.locks.current()?.key };
  }

  // As compiled without decorator metadata (esbuild, as under Vitest): no design:paramtypes, and a
  // default value, so the method's length (0) does not count the parameter either.
  @Get(':id/untyped')
  @Locked('item:<0>')
  @WithoutParamTypes()
  async untyped(@Param('id') id = 'none') {
    return { id, key: this.locks.current()?.key };
  }

  // A parameter with a default value after the decorated one: the method's length (1) does not
  // count it, the parameter types TypeScript recorded do.
  @Get(':id/page')
  @Locked('item:<0>')
  async page(@Param('id') id: string, page = 1) {
    return { id, page, key: this.locks.current()?.key };
  }

  // Compiled without decorator metadata, with a parameter no decorator fills: the method's length (2) counts it.
  @Get(':id/noted')
  @Locked('item:<0>')
  @WithoutParamTypes()
  async noted(@Param('id') id: string, note?: string) {
    return { id, note: note ?? null, key: this.locks.current()?.key };
  }

  /** Sends its response itself through the platform's response object (@Res(): express res, fastify reply). */
  @Post(':id/raw')
  @Locked('item:<0>')
  async raw(@Param('id') id: string, @Res() res: { send(body: unknown): unknown }) {
    const wait = holding.get(`item:${id}`);
    if (wait) {
      wait.entered();
      await wait.release;
    }
    res.send({ id, key: this.locks.current()?.key });
  }

  /** A download: the method returns the stream, which the client reads after the method returned. */
  @Get(':id/download')
  @Locked('download:<0>')
  async download(@Param('id') id: string): Promise<StreamableFile> {
    const body = new PassThrough();
    body.write('first chunk\n');
    downloads.set(id, body);
    return new StreamableFile(body);
  }

  // Composed with applyDecorators, in both orders; with a parameter (Nest passes the call site)
  // and without (@Locked applied before the route: the interceptor translates).
  @LockedGet(':id/composed/lock-outer', 'item:<0>')
  async composedLockOuter(@Param('id') id: string) {
    return { key: this.locks.current()?.key };
  }

  @GetLocked(':id/composed/route-outer', 'item:<0>')
  async composedRouteOuter(@Param('id') id: string) {
    return { key: this.locks.current()?.key };
  }

  @LockedGet('composed/all/lock-outer', 'items:all')
  async composedAllLockOuter() {
    return { key: this.locks.current()?.key };
  }

  @GetLocked('composed/all/route-outer', 'items:all')
  async composedAllRouteOuter() {
    return { key: this.locks.current()?.key };
  }

  @Sse(':id/stream')
  @Locked('stream:<0>')
  stream(@Param('id') id: string): Observable<{ data: { n: number } }> {
    // An event's data is a string or an object (MessageEvent): a number would error the stream.
    return interval(20).pipe(map((n) => ({ data: { n } })));
  }
}

@Module({
  imports: [],
  controllers: [ItemsController],
  providers: [Inventory],
})
class ItemsModule {}

for (const platform of ['express', 'fastify'] as const) {
  describe(`@Locked on HTTP controllers (${platform})`, () => {
    let redis: RedisServer;
    let app: INestApplication;
    let url: string;
    let locks: LockService;
    const logger = new CapturingLogger();
    const handlerNames = new HandlerNames();
    beforeAll(async () => {
      redis = await RedisServer.start();
      @Module({ imports: [LockModule.forRoot({ redis: redis.url, isGlobal: true, waitMs: 300 }), ItemsModule] })
      class AppModule {}
      app =
        platform === 'express'
          ? await NestFactory.create(AppModule, { logger })
          : await NestFactory.create(AppModule, new FastifyAdapter(), { logger });
      app.useGlobalGuards(handlerNames);
      url = await listening(app);
      locks = app.get(LockService);
    });
    afterAll(async () => {
      await app?.close();
      await redis?.stop();
    });

    it('registers routes whichever side of the route decorator @Locked sits', async () => {
      expect((await fetch(`${url}/items/7`)).status).toBe(200);
      expect((await fetch(`${url}/items/transfer`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{"source":"a","target":"b"}' })).status).toBe(201);
    });

    it("shows guards and interceptors the method's own name as the handler's, whichever side of the route decorator @Locked sits", async () => {
      // Rate limiters (@nestjs/throttler's keys) and loggers name a route by context.getHandler().name.
      handlerNames.seen.length = 0;
      expect((await fetch(`${url}/items/8`)).status).toBe(200);
      expect((await fetch(`${url}/items/all/above`)).status).toBe(200);
      expect(handlerNames.seen).toEqual(['ItemsController.get', 'ItemsController.listAbove']);
    });

    it('builds the key from the arguments after pipes (ParseIntPipe) and re-enters in nested locked calls', async () => {
      const acquired = nextEvent(locks.events$, 'acquired', (e) => e.key.startsWith('item:'));
      const body = await (await fetch(`${url}/items/0042`)).json();
      expect((await acquired).key).toBe('item:42');
      expect(body).toEqual({ id: 42, key: 'item:42', nested: { holdCount: 2, key: 'item:42' } });
    });

    it('passes the call site after every parameter of a handler compiled without decorator metadata', async () => {
      expect(await (await fetch(`${url}/items/5/untyped`)).json()).toEqual({ id: '5', key: 'item:5' });
    });

    it('passes the call site after every parameter the method declares, decorated or not, so a call of its own with all of them runs locked', async () => {
      // Unit tests and other providers call controller methods so; one more argument would be taken
      // for a call site a pipe replaced.
      expect(await (await fetch(`${url}/items/6/page`)).json()).toEqual({ id: '6', page: 1, key: 'item:6' });
      expect(await (await fetch(`${url}/items/6/noted`)).json()).toEqual({ id: '6', note: null, key: 'item:6' });
      const controller = app.get(ItemsController);
      await expect(controller.page('6', 3)).resolves.toEqual({ id: '6', page: 3, key: 'item:6' });
      await expect(controller.noted('6', 'n')).resolves.toEqual({ id: '6', note: 'n', key: 'item:6' });
    });

    it('builds the key from a transformed DTO through a property path', async () => {
      const res = await fetch(`${url}/items/transfer`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ source: 'acc:1', target: 'acc:2' }),
      });
      // The pipe upper-cased the values; ':' inside a value is encoded.
      expect(await res.json()).toEqual({ key: 'transfer:ACC%3A1:ACC%3A2' });
    });

    it('answers 409 with Retry-After and a body naming the lock while another owner holds it', async () => {
      const holder = await locks.acquire('item:5', { leaseMs: 4_000 });
      const res = await fetch(`${url}/items/5`);
      expect(res.status).toBe(409);
      const retryAfter = Number(res.headers.get('retry-after'));
      expect(retryAfter).toBeGreaterThanOrEqual(3);
      expect(retryAfter).toBeLessThanOrEqual(4);
      const body = (await res.json()) as Record<string, unknown>;
      expect(body).toMatchObject({ statusCode: 409, error: 'Conflict', code: 'LOCK_NOT_ACQUIRED', key: 'item:5', retryAfterMs: expect.any(Number) });
      expect(body.message).toMatch(/Lock "item:5" is held by another owner/);
      await holder.release();
      expect((await fetch(`${url}/items/5`)).status).toBe(200);
    });

    it('makes two concurrent requests for one key contend, and serves both in turn', async () => {
      const entered = gate();
      const finish = gate();
      holding.set('item:9', { entered: entered.open, release: finish.promise });
      const first = fetch(`${url}/items/9`);
      await entered.promise;
      holding.delete('item:9');
      const contended = nextEvent(locks.events$, 'contended', (e) => e.key === 'item:9');
      const second = fetch(`${url}/items/9`);
      await contended;
      finish.open();
      expect((await first).status).toBe(200);
      expect((await second).status).toBe(200);
    });

    it('fails at once with onContention: fail', async () => {
      const holder = await locks.acquire('item:6');
      const seen: string[] = [];
      const watching = locks.events$.subscribe((e) => void (e.key === 'item:6' && seen.push(e.type)));
      const res = await fetch(`${url}/items/6/fail`);
      watching.unsubscribe();
      expect(res.status).toBe(409);
      // One refused attempt, no wait: a wait (waitMs 300 here) would end with 'timed-out'.
      expect(seen).toEqual(['contended']);
      await holder.release();
    });

    // What the README says of 'skip' on a route: the client cannot tell a skipped call from one that returned nothing.
    it("answers a call skipped with onContention: 'skip' as the handler returning undefined does: 200 with an empty body", async () => {
      expect(await (await fetch(`${url}/items/8/skip`)).json()).toEqual({ id: '8' });
      const holder = await locks.acquire('item:8');
      const skipped = nextEvent(locks.events$, 'skipped', (e) => e.key === 'item:8');
      const res = await fetch(`${url}/items/8/skip`);
      await skipped;
      expect(res.status).toBe(200);
      expect(await res.text()).toBe('');
      expect(res.headers.get('retry-after')).toBeNull();
      await holder.release();
    });

    it('answers 409 from handlers without parameters on either side of the route decorator', async () => {
      expect(await (await fetch(`${url}/items/all/above`)).json()).toEqual({ key: 'items:all' });
      expect(await (await fetch(`${url}/items/all/below`)).json()).toEqual({ key: 'items:all' });
      const holder = await locks.acquire('items:all', { leaseMs: 4_000 });
      for (const path of ['all/above', 'all/below']) {
        const res = await fetch(`${url}/items/${path}`);
        expect(res.status).toBe(409);
        expect(Number(res.headers.get('retry-after'))).toBeGreaterThanOrEqual(1);
        expect(await res.json()).toMatchObject({ code: 'LOCK_NOT_ACQUIRED', key: 'items:all' });
      }
      await holder.release();
    });

    it('locks handlers whose route and @Locked a decorator of the project composes with applyDecorators, in either order, and answers 409 for them', async () => {
      // Each composed route with the key it locks.
      const routes = [
        ['4/composed/lock-outer', 'item:4'],
        ['4/composed/route-outer', 'item:4'],
        ['composed/all/lock-outer', 'items:all'],
        ['composed/all/route-outer', 'items:all'],
      ] as const;
      for (const [path, key] of routes) expect(await (await fetch(`${url}/items/${path}`)).json()).toEqual({ key });
      const holders = [await locks.acquire('item:4', { leaseMs: 4_000 }), await locks.acquire('items:all', { leaseMs: 4_000 })];
      for (const [path, key] of routes) {
        const res = await fetch(`${url}/items/${path}`);
        expect(res.status).toBe(409);
        expect(Number(res.headers.get('retry-after'))).toBeGreaterThanOrEqual(1);
        expect(await res.json()).toMatchObject({ code: 'LOCK_NOT_ACQUIRED', key });
      }
      for (const holder of holders) await holder.release();
    });

    it('locks a handler that sends its own response with @Res(), and answers 409 with Retry-After for it when another owner holds the lock', async () => {
      const entered = gate();
      const release = gate();
      holding.set('item:r1', { entered: entered.open, release: release.promise });
      const first = fetch(`${url}/items/r1/raw`, { method: 'POST' });
      await entered.promise;
      expect(await locks.isLocked('item:r1')).toBe(true);
      const contended = await fetch(`${url}/items/r1/raw`, { method: 'POST' });
      expect(contended.status).toBe(409);
      expect(Number(contended.headers.get('retry-after'))).toBeGreaterThanOrEqual(1);
      expect(await contended.json()).toMatchObject({ statusCode: 409, code: 'LOCK_NOT_ACQUIRED', key: 'item:r1' });
      release.open();
      holding.delete('item:r1');
      const res = await first;
      expect(res.status).toBe(201);
      expect(await res.json()).toEqual({ id: 'r1', key: 'item:r1' });
      expect(await locks.isLocked('item:r1')).toBe(false);
    });

    it('passes the handler\'s own exceptions through unchanged', async () => {
      const res = await fetch(`${url}/items/3/missing`);
      expect(res.status).toBe(404);
      expect(((await res.json()) as { message: string }).message).toBe('item 3 does not exist');
      expect(await locks.isLocked('item:3')).toBe(false);
    });

    it('holds the lock of a method returning a StreamableFile until it returns: the client reads the stream after the release', async () => {
      const key = `download:d-${platform}`;
      const res = await fetch(`${url}/items/d-${platform}/download`);
      expect(res.status).toBe(200);
      const reader = res.body!.getReader();
      const decoder = new TextDecoder();
      let received = decoder.decode((await reader.read()).value, { stream: true });
      expect(received).toBe('first chunk\n');
      // The body is still open, and the lock is already free.
      expect(await locks.isLocked(key)).toBe(false);
      downloads.get(`d-${platform}`)!.end('last chunk\n');
      for (let chunk = await reader.read(); !chunk.done; chunk = await reader.read()) received += decoder.decode(chunk.value, { stream: true });
      expect(received).toBe('first chunk\nlast chunk\n');
    });

    it('holds the lock while a stream is open and releases it when the client goes away', async () => {
      const acquired = nextEvent(locks.events$, 'acquired', (e) => e.key === 'stream:s1');
      const controller = new AbortController();
      const res = await fetch(`${url}/items/s1/stream`, { signal: controller.signal });
      const reader = res.body!.getReader();
      // Three events have arrived: the stream is open (not ended by an error) and holds the lock.
      const decoder = new TextDecoder();
      let received = '';
      while ((received.match(/^data: /gm) ?? []).length < 3) {
        const { value, done } = await reader.read();
        expect(done).toBe(false);
        received += decoder.decode(value, { stream: true });
      }
      expect(received).toContain('data: {"n":2}');
      await acquired;
      expect(await locks.isLocked('stream:s1')).toBe(true);
      const released = nextEvent(locks.events$, 'released', (e) => e.key === 'stream:s1');
      controller.abort();
      await reader.cancel().catch(() => undefined);
      await released;
      expect(await locks.isLocked('stream:s1')).toBe(false);
    });

    it('answers 409 with Retry-After 1 and no retryAfterMs when the lock key has no expiry (not written by nestjs-locked)', async () => {
      const raw = redis.client();
      await raw.hset('lock:{item:6}', 'someone', '1'); // no PEXPIRE: no lease to wait for
      try {
        const res = await fetch(`${url}/items/6/fail`);
        expect(res.status).toBe(409);
        expect(res.headers.get('retry-after')).toBe('1');
        const body = (await res.json()) as Record<string, unknown>;
        expect(body).toMatchObject({ code: 'LOCK_NOT_ACQUIRED', key: 'item:6' });
        expect(body).not.toHaveProperty('retryAfterMs');
      } finally {
        await raw.del('lock:{item:6}');
      }
    });

    it('answers 503 LOCK_UNAVAILABLE, and logs the cause once for the whole outage, when Redis does not answer', async () => {
      const logged = logger.entries.length;
      const lines = (level: string) => logger.entries.slice(logged).filter((e) => e.level === level && e.context === 'LockService').map((e) => e.message);
      redis.pause(); // connections stay open, nothing answers: each attempt ends at its 1 s bound
      try {
        // The call-site path (a parameter) and both sides of the route decorator without parameters.
        const responses = await Promise.all(['1', 'all/above', 'all/below'].map((path) => fetch(`${url}/items/${path}`)));
        for (const [i, res] of responses.entries()) {
          const key = i === 0 ? 'item:1' : 'items:all';
          expect(res.status).toBe(503);
          expect(res.headers.get('retry-after')).toBeNull();
          const body = (await res.json()) as Record<string, unknown>;
          expect(body).toMatchObject({ statusCode: 503, error: 'Service Unavailable', code: 'LOCK_UNAVAILABLE', key });
          // The body does not pass on the cause (which may name servers); the log has it.
          expect(body.message).toBe(`Lock "${key}" is unavailable right now: its Redis store failed or did not answer, or the application is shutting down. Retry later.`);
        }
        // One error line for the three, with the first one's cause; the others are counted.
        expect(loggedUnavailable(logger, 'item:1') || loggedUnavailable(logger, 'items:all')).toBe(true);
        expect(lines('error')).toHaveLength(1);
        expect(lines('error')[0]).toMatch(/no answer within/);
      } finally {
        redis.resume();
      }
      expect((await fetch(`${url}/items/1`)).status).toBe(200);
      // The first lock granted after the outage says how many were not logged one by one.
      expect(lines('log')).toEqual(['locks can be had again; 2 more @Locked calls were answered "unavailable" after the last line about them']);
      expect(lines('error')).toHaveLength(1);
    });

    it('answers as soon as the handler is done when Redis stops answering meanwhile: the release gives up after 1 s, and runs once Redis is back', async () => {
      const logged = logger.entries.length;
      const lines = (level: string) => logger.entries.slice(logged).filter((e) => e.level === level && e.context === 'LockService').map((e) => e.message);
      const entered = gate();
      const finish = gate();
      holding.set('item:77', { entered: entered.open, release: finish.promise });
      const response = fetch(`${url}/items/77/held`);
      await entered.promise;
      holding.delete('item:77');
      const failed = nextEvent(locks.events$, 'release-failed', (e) => e.key === 'item:77');
      redis.pause(); // connections stay open, nothing answers
      try {
        finish.open();
        // Without a bound of its own the release would wait for as long as Redis does.
        const res = await within(response, 5_000);
        expect(res.status).toBe(200);
        expect(await res.json()).toEqual({ id: '77' });
        expect(((await failed).error as Error).message).toMatch(/^Redis failed during release of "item:77": no answer within 1000 ms\./);
        expect(lines('error')).toEqual([expect.stringMatching(/^could not release "item:77"; its lease will free it: /)]);
      } finally {
        redis.resume();
      }
      // The release was still sent: Redis runs it before this read, which follows it on the same connection.
      expect(await locks.isLocked('item:77')).toBe(false);
      expect((await fetch(`${url}/items/77/held`)).status).toBe(200);
      expect(lines('error')).toHaveLength(1);
    });
  });
}

describe('which @Locked handlers carry LockInterceptor', () => {
  const interceptors = (method: unknown) => (Reflect.getMetadata('__interceptors__', method as object) as unknown[] | undefined) ?? [];
  it('only those where Nest cannot pass the call site (no parameter decorators, @Locked below the route)', () => {
    const handlers = ItemsController.prototype as unknown as Record<string, unknown>;
    for (const name of ['get', 'transfer', 'held', 'missing', 'failFast', 'stream', 'listAbove']) expect(interceptors(handlers[name])).not.toContain(LockInterceptor);
    expect(interceptors(handlers.listBelow)).toContain(LockInterceptor);
    // The same through applyDecorators: @Locked applied before the route is the inner one.
    for (const name of ['composedLockOuter', 'composedRouteOuter', 'composedAllLockOuter']) expect(interceptors(handlers[name])).not.toContain(LockInterceptor);
    expect(interceptors(handlers.composedAllRouteOuter)).toContain(LockInterceptor);
  });
});

/** An application-wide filter that reshapes every HttpException: it must see the lock's answers too. */
@Catch(HttpException)
class ReshapingFilter implements ExceptionFilter {
  catch(exception: HttpException, host: ArgumentsHost) {
    const response = host.switchToHttp().getResponse<{ status(code: number): { json(body: unknown): void } }>();
    // The lock error rides along as the exception's cause, for filters like this one.
    const cause = exception.cause instanceof Error ? exception.cause.name : undefined;
    response.status(exception.getStatus()).json({ reshaped: true, original: exception.getResponse(), cause });
  }
}

describe('LockInterceptor options and loss', () => {
  let redis: RedisServer;
  let app: INestApplication;
  let url: string;
  let locks: LockService;

  @Controller('jobs')
  class JobsController {
    constructor(private readonly locks: LockService) {}

    @Post(':id')
    @Locked('job:<0>', { onContention: 'fail' })
    async start(@Param('id') id: string) {
      return { id };
    }

    /** Loses its lock mid-request (the key is deleted behind its back) and stops, as a handler should. */
    @Post(':id/long')
    @Locked('job:<0>', { leaseMs: 600, watchdog: true })
    async long(@Param('id') id: string) {
      const lock = this.locks.current()!;
      await redis.client().del(`lock:{job:${id}}`);
      await new Promise((resolve) => lock.signal.addEventListener('abort', resolve, { once: true }));
      lock.signal.throwIfAborted();
    }

    /**
     * The same as an Observable the method does not declare (no return type): the call gives Nest a
     * Promise of it, and the loss errors the Observable.
     */
    @Post(':id/long-stream')
    @Locked('job:<0>', { leaseMs: 600, watchdog: true })
    longStream(@Param('id') id: string) {
      const lock = this.locks.current()!;
      return from(redis.client().del(`lock:{job:${id}}`)).pipe(
        mergeMap(() => new Observable<never>((subscriber) => lock.signal.addEventListener('abort', () => subscriber.error(lock.signal.reason), { once: true }))),
      );
    }
  }

  beforeAll(async () => {
    redis = await RedisServer.start();
    @Module({ imports: [LockModule.forRoot({ redis: redis.url, contendedHttpStatus: 423 })], controllers: [JobsController] })
    class AppModule {}
    app = await NestFactory.create(AppModule, { logger: new CapturingLogger() });
    app.useGlobalFilters(new ReshapingFilter());
    url = await listening(app);
    locks = app.get(LockService);
  });
  afterAll(async () => {
    await app?.close();
    await redis?.stop();
  });

  it('answers 423 Locked when configured so, through the application\'s own exception filter', async () => {
    const holder = await locks.acquire('job:1');
    const res = await fetch(`${url}/jobs/1`, { method: 'POST' });
    expect(res.status).toBe(423);
    expect(await res.json()).toMatchObject({ reshaped: true, original: { statusCode: 423, error: 'Locked', key: 'job:1' }, cause: 'LockNotAcquiredError' });
    expect(res.headers.get('retry-after')).not.toBeNull();
    await holder.release();
  });

  it('rounds Retry-After up to whole seconds, and never says 0 when the holder\'s lease has already ended', async () => {
    // retryAfterMs 0 is what a Redlock quorum that granted too late reports (nobody holds the lock:
    // retry at once; redlock.spec). Redis gives 0 too for a lease in its last millisecond, which a
    // test cannot aim at, so the error is built here and translated for an HTTP response that
    // records its headers.
    const sent: string[] = [];
    const response = { setHeader: (name: string, value: string) => sent.push(`${name}: ${value}`) };
    const context = { getType: () => 'http', switchToHttp: () => ({ getResponse: () => response }) } as unknown as ExecutionContext;
    for (const ms of [0, 1, 1_000, 1_001, 27_493]) {
      const translated = (await translateLockError(new LockNotAcquiredError('job:7', ms, 0, 'contended'), context, locks)) as HttpException;
      expect(translated).toBeInstanceOf(HttpException);
      expect(translated.getStatus()).toBe(423);
      expect(translated.getResponse()).toMatchObject({ code: 'LOCK_NOT_ACQUIRED', key: 'job:7', retryAfterMs: ms });
    }
    expect(sent).toEqual(['Retry-After: 1', 'Retry-After: 1', 'Retry-After: 1', 'Retry-After: 2', 'Retry-After: 28']);
  });

  it('leaves a lock error as it is for an execution context of a type it does not know (a library\'s own transport)', async () => {
    const context = { getType: () => 'necord' } as unknown as ExecutionContext;
    for (const error of [new LockNotAcquiredError('job:8', 1_000, 0, 'contended'), new LockBackendError('acquire', 'job:8', new Error('down'))]) {
      expect(await translateLockError(error, context, locks)).toBe(error);
    }
  });

  it('answers 503 when the handler stopped because its lock was lost', async () => {
    const res = await fetch(`${url}/jobs/2/long`, { method: 'POST' });
    expect(res.status).toBe(503);
    expect(await res.json()).toMatchObject({ reshaped: true, original: { statusCode: 503, code: 'LOCK_LOST', key: 'job:2' }, cause: 'LockLostError' });
  });

  it('answers 503 when an Observable the handler returned without declaring it errors because its lock was lost', async () => {
    const res = await fetch(`${url}/jobs/3/long-stream`, { method: 'POST' });
    expect(res.status).toBe(503);
    expect(await res.json()).toMatchObject({ reshaped: true, original: { statusCode: 503, code: 'LOCK_LOST', key: 'job:3' }, cause: 'LockLostError' });
  });
});

describe('LockInterceptor registered globally (APP_INTERCEPTOR)', () => {
  let redis: RedisServer;
  let app: INestApplication;
  let url: string;
  let locks: LockService;

  @Controller('global')
  class GlobalController {
    constructor(private readonly locks: LockService) {}

    // With the extra parameter (@Param), and without it (LockInterceptor applied by @Locked too).
    @Post(':id')
    @Locked('global:<0>', { onContention: 'fail' })
    async locked(@Param('id') id: string) {
      return { id };
    }

    @Locked('global:bare', { onContention: 'fail' })
    @Post()
    async bare() {
      return { bare: true };
    }

    /** No @Locked: a lock failure of its own code is its own business, left as it is (a 500). */
    @Post(':id/by-hand')
    async byHand(@Param('id') id: string) {
      return this.locks.run(`global:${id}`, async () => ({ id }), { waitMs: 0 });
    }
  }

  beforeAll(async () => {
    redis = await RedisServer.start();
    @Module({
      imports: [LockModule.forRoot({ redis: redis.url })],
      controllers: [GlobalController],
      providers: [{ provide: APP_INTERCEPTOR, useClass: LockInterceptor }],
    })
    class AppModule {}
    app = await NestFactory.create(AppModule, { logger: new CapturingLogger() });
    url = await listening(app);
    locks = app.get(LockService);
  });
  afterAll(async () => {
    await app?.close();
    await redis?.stop();
  });

  it('answers contention on @Locked handlers with one 409, however @Locked got its transport side', async () => {
    for (const [path, key] of [['/global/1', 'global:1'], ['/global', 'global:bare']] as const) {
      expect((await fetch(`${url}${path}`, { method: 'POST' })).status).toBe(201);
      const holder = await locks.acquire(key);
      try {
        const res = await fetch(`${url}${path}`, { method: 'POST' });
        expect([path, res.status]).toEqual([path, 409]);
        expect(await res.json()).toMatchObject({ statusCode: 409, error: 'Conflict', code: 'LOCK_NOT_ACQUIRED', key });
      } finally {
        await holder.release();
      }
    }
  });

  it('leaves handlers without @Locked untouched: their own lock failure stays what it was (500)', async () => {
    expect((await fetch(`${url}/global/2/by-hand`, { method: 'POST' })).status).toBe(201);
    const holder = await locks.acquire('global:2');
    try {
      expect((await fetch(`${url}/global/2/by-hand`, { method: 'POST' })).status).toBe(500);
    } finally {
      await holder.release();
    }
  });
});

describe('503 LOCK_UNAVAILABLE from replica confirmation and the Redlock quorum', () => {
  @Controller('reports')
  class ReportsController {
    @Post(':id')
    @Locked('report:<0>', { onContention: 'fail' })
    async build(@Param('id') id: string) {
      return { id };
    }
  }
  const servers: RedisServer[] = [];
  const apps: INestApplication[] = [];
  afterAll(async () => {
    for (const app of apps) await app.close();
    for (const server of servers) await server.stop();
  });
  async function serve(options: Parameters<typeof LockModule.forRoot>[0], logger: CapturingLogger): Promise<string> {
    @Module({ imports: [LockModule.forRoot(options)], controllers: [ReportsController] })
    class AppModule {}
    const app = await NestFactory.create(AppModule, { logger });
    apps.push(app);
    return listening(app);
  }

  it('answers 503 when no replica confirms the grant (LockReplicationError), and logs why', async () => {
    const master = await RedisServer.start(); // no replica: WAIT 1 always times out
    servers.push(master);
    const logger = new CapturingLogger();
    const url = await serve({ redis: master.url, replication: { replicas: 1, timeoutMs: 50 } }, logger);
    const res = await fetch(`${url}/reports/1`, { method: 'POST' });
    expect(res.status).toBe(503);
    expect(await res.json()).toMatchObject({ statusCode: 503, code: 'LOCK_UNAVAILABLE', key: 'report:1' });
    expect(logger.at('error').some((m) => m.includes('0 of 1 required replica'))).toBe(true);
    expect(await master.shared().exists('lock:{report:1}')).toBe(0); // the unconfirmed grant was given back
  });

  it('answers 503 when a majority of Redlock nodes does not answer (LockQuorumError), and logs the votes', async () => {
    const nodes = await Promise.all([RedisServer.start(), RedisServer.start(), RedisServer.start()]);
    servers.push(...nodes);
    const logger = new CapturingLogger();
    // The default 30 s lease: each node is given 500 ms, and the quorum's answer comes before the
    // attempt's own 1 s bound (which would say only "no answer within 1000 ms").
    const url = await serve({ redlock: { clients: nodes.map((n) => n.url) } }, logger);
    nodes[1]!.pause();
    nodes[2]!.pause();
    const res = await fetch(`${url}/reports/2`, { method: 'POST' });
    expect(res.status).toBe(503);
    expect(await res.json()).toMatchObject({ statusCode: 503, code: 'LOCK_UNAVAILABLE', key: 'report:2' });
    expect(logger.at('error').some((m) => m.includes('needs 2 of 3 nodes'))).toBe(true);
    nodes[1]!.resume();
    nodes[2]!.resume();
  });
});
