import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import {
  Body,
  Controller,
  Module,
  Param,
  ParseIntPipe,
  Post,
  ValidationPipe,
  type ArgumentMetadata,
  type INestApplication,
  type PipeTransform,
} from '@nestjs/common';
import { NestFactory } from '@nestjs/core';
import { IsInt, IsString, Min } from 'class-validator';
import { Locked, LockConfigurationError, LockModule, LockService } from '../../lib/index.js';
import { CapturingLogger, listening } from '../support/lock-testing.js';
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

/** Returns only the values of the parameter types it knows: what a pipe that forgot its last `return value` does. */
class DroppingPipe implements PipeTransform {
  transform(value: unknown, metadata: ArgumentMetadata) {
    if (metadata.type === 'body' || metadata.type === 'param') return value;
    return undefined;
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

  async function serve(configure: (app: INestApplication) => void, logger = new CapturingLogger()): Promise<{ app: INestApplication; url: string }> {
    @Module({ imports: [LockModule.forRoot({ redis: redis.url, waitMs: 200 })], controllers: [OrdersController] })
    class AppModule {}
    const app = await NestFactory.create(AppModule, { logger });
    apps.push(app);
    configure(app);
    return { app, url: await listening(app) };
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
    const logger = new CapturingLogger();
    const { app, url } = await serve((a) => a.useGlobalPipes(new CopyingPipe()), logger);
    const controller = app.get(OrdersController);
    const calls = controller.calls;

    // Nest's own exception handler answers the unknown error with a 500 and logs it.
    const res = await post(url, { id: 'B7', qty: 1 });
    expect(res.status).toBe(500);
    const message =
      /^@Locked on OrdersController\.place: the parameter @Locked declares after the method's own \(index 2, type 'custom', no metatype\) reached the method as an object \(Object\), not as the LockCallSite Nest filled in: a pipe changed it\. A global or controller-wide pipe must return the value of a 'custom' parameter it does not know unchanged/;
    const logged = logger.at('error').filter((m) => m.includes('a pipe changed it'));
    expect(logged).toHaveLength(1);
    expect(logged[0]).toMatch(/^LockConfigurationError: /);
    expect(logged[0]!.slice('LockConfigurationError: '.length)).toMatch(message);
    expect(controller.calls).toBe(calls);
    expect(await redis.shared().exists('lock:{order:42:B7}')).toBe(0);

    // The same refusal, typed, when the method is handed a third argument that is not the call site.
    const dto = Object.assign(new OrderDto(), { id: 'B7', qty: 1 });
    const refused = (controller.place as (...a: unknown[]) => Promise<unknown>).call(controller, 42, dto, { context: {} });
    await expect(refused).rejects.toBeInstanceOf(LockConfigurationError);
    await expect(refused).rejects.toThrow(message);
    // Called directly with its own arguments only, the method still locks and runs.
    await expect(controller.place(42, dto)).resolves.toMatchObject({ key: 'order:42:B7', args: 2 });
  });

  it('refuses the call the same way when a pipe turned the call site into undefined', async () => {
    const logger = new CapturingLogger();
    const { app, url } = await serve((a) => a.useGlobalPipes(new DroppingPipe()), logger);
    const controller = app.get(OrdersController);
    const calls = controller.calls;
    expect((await post(url, { id: 'C3', qty: 1 })).status).toBe(500);
    const logged = logger.at('error').filter((m) => m.includes('a pipe changed it'));
    expect(logged).toHaveLength(1);
    expect(logged[0]).toContain("@Locked on OrdersController.place: the parameter @Locked declares after the method's own (index 2, type 'custom', no metatype) reached the method as undefined");
    expect(controller.calls).toBe(calls);
    expect(await redis.shared().exists('lock:{order:42:C3}')).toBe(0);
  });
});
