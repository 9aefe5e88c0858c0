import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import {
  Body,
  Catch,
  Controller,
  Module,
  Param,
  ParseIntPipe,
  Post,
  ValidationPipe,
  type ArgumentMetadata,
  type ArgumentsHost,
  type ExceptionFilter,
  type INestApplication,
  type PipeTransform,
} from '@nestjs/common';
import { NestFactory } from '@nestjs/core';
import { IsInt, IsString, Min } from 'class-validator';
import { Locked, LockConfigurationError, LockModule, LockService } from '../../lib/index.js';
import { CapturingLogger } from '../support/lock-testing.js';
import { RedisServer } from '../support/redis-server.js';

// @Locked declares one custom parameter after a handler's own (README, "How it is built"), and
// every global pipe is shown it. These tests run a @Locked route under the global pipe most Nest
// apps register (ValidationPipe with transform and whitelist, here validating custom parameters
// too), and under a pipe that replaces the values it is given, which @Locked must refuse loudly
// instead of answering contention with a 500.

class OrderDto {
  @IsString() id!: string;
  @IsInt() @Min(1) qty!: number;
}

/** Records what a global pipe is shown, and passes every value through. */
class RecordingPipe implements PipeTransform {
  readonly seen: ArgumentMetadata[] = [];
  transform(value: unknown, metadata: ArgumentMetadata) {
    this.seen.push(metadata);
    return value;
  }
}

/** Copies every object it is given: what a careless sanitising pipe does. */
class CopyingPipe implements PipeTransform {
  transform(value: unknown) {
    return value !== null && typeof value === 'object' ? { ...value } : value;
  }
}

@Catch()
class CatchAll implements ExceptionFilter {
  readonly caught: unknown[] = [];
  catch(error: unknown, host: ArgumentsHost) {
    this.caught.push(error);
    host.switchToHttp().getResponse<{ status(code: number): { json(body: unknown): void } }>().status(500).json({ statusCode: 500 });
  }
}

@Controller('orders')
class OrdersController {
  calls = 0;
  constructor(private readonly locks: LockService) {}

  @Post(':shop')
  @Locked('order:<0>:<1.id>')
  async place(@Param('shop', ParseIntPipe) shop: number, @Body() order: OrderDto) {
    this.calls++;
    // arguments.length: how many arguments the method itself was given (the call site removed).
    return { key: this.locks.current()?.key, dto: order instanceof OrderDto, qty: order.qty, shop, args: arguments.length };
  }
}

describe('@Locked under global pipes', () => {
  let redis: RedisServer;
  const apps: INestApplication[] = [];

  async function serve(configure: (app: INestApplication) => void): Promise<{ app: INestApplication; url: string }> {
    @Module({ imports: [LockModule.forRoot({ redis: redis.url, waitMs: 200 })], controllers: [OrdersController] })
    class AppModule {}
    const app = await NestFactory.create(AppModule, { logger: new CapturingLogger() });
    apps.push(app);
    configure(app);
    await app.listen(0, '127.0.0.1');
    return { app, url: (await app.getUrl()).replace('[::1]', '127.0.0.1') };
  }

  const post = (url: string, body: unknown) =>
    fetch(`${url}/orders/0042`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });

  beforeAll(async () => {
    redis = await RedisServer.start();
  });
  afterAll(async () => {
    for (const app of apps) await app.close();
    await redis?.stop();
  });

  it('works under ValidationPipe({ transform, whitelist, forbidNonWhitelisted, validateCustomDecorators }): the key follows the DTO, contention answers 409', async () => {
    const recording = new RecordingPipe();
    const { app, url } = await serve((a) => a.useGlobalPipes(new ValidationPipe({ transform: true, whitelist: true, forbidNonWhitelisted: true, validateCustomDecorators: true }), recording));
    const controller = app.get(OrdersController);

    const ok = await post(url, { id: 'A1', qty: 2 });
    expect(ok.status).toBe(201);
    // The handler got its two arguments, the body as a validated OrderDto; the call site was removed.
    expect(await ok.json()).toEqual({ key: 'order:42:A1', dto: true, qty: 2, shop: 42, args: 2 });
    // What the global pipes were shown for the call site: a custom parameter with no metatype.
    const custom = recording.seen.filter((m) => m.type === 'custom');
    expect(custom).toHaveLength(1);
    expect(custom[0]!.metatype).toBeUndefined();

    // ValidationPipe still refuses a bad body before the handler (and so the lock) is reached.
    const calls = controller.calls;
    expect((await post(url, { id: 'A1', qty: 2, extra: true })).status).toBe(400);
    expect(controller.calls).toBe(calls);

    const holder = await app.get(LockService).acquire('order:42:A1', { leaseMs: 4_000 });
    const contended = await post(url, { id: 'A1', qty: 2 });
    expect(contended.status).toBe(409);
    expect(Number(contended.headers.get('retry-after'))).toBeGreaterThanOrEqual(1);
    expect(await contended.json()).toMatchObject({ code: 'LOCK_NOT_ACQUIRED', key: 'order:42:A1' });
    expect(controller.calls).toBe(calls);
    await holder.release();
    expect((await post(url, { id: 'A1', qty: 3 })).status).toBe(201);
  });

  it('refuses the call with a LockConfigurationError naming the method when a pipe replaced the call site, and takes no lock', async () => {
    const filter = new CatchAll();
    const { app, url } = await serve((a) => a.useGlobalPipes(new CopyingPipe()).useGlobalFilters(filter));
    const controller = app.get(OrdersController);
    const calls = controller.calls;

    const res = await post(url, { id: 'B7', qty: 1 });
    expect(res.status).toBe(500);
    expect(filter.caught).toHaveLength(1);
    const error = filter.caught[0];
    expect(error).toBeInstanceOf(LockConfigurationError);
    expect((error as Error).message).toMatch(
      /^@Locked on OrdersController\.place: the parameter @Locked declares after the method's own \(index 2, type 'custom', no metatype\) reached the method as an object \(Object\), not as the LockCallSite Nest filled in: a pipe changed it\. A global or controller-wide pipe must return the value of a 'custom' parameter it does not know unchanged/,
    );
    expect(controller.calls).toBe(calls);
    expect(await redis.shared().exists('lock:{order:42:B7}')).toBe(0);

    // Called directly, with its own arguments only, the method still locks and runs.
    await expect(controller.place(42, Object.assign(new OrderDto(), { id: 'B7', qty: 1 }))).resolves.toMatchObject({ key: 'order:42:B7', args: 2 });
  });
});
