import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { ApolloDriver, type ApolloDriverConfig } from '@nestjs/apollo';
import { Module, type DynamicModule, type ExecutionContext, type INestApplication } from '@nestjs/common';
import { NestFactory } from '@nestjs/core';
import { Args, Field, GraphQLModule, Int, Mutation, ObjectType, Query, Resolver } from '@nestjs/graphql';
import { MercuriusDriver, type MercuriusDriverConfig } from '@nestjs/mercurius';
import { FastifyAdapter } from '@nestjs/platform-fastify';
import { Locked, LockGraphQLError, LockModule, LockNotAcquiredError, LockService } from '../../lib/index.js';
import { translateLockError } from '../../lib/lock.interceptor.js';
import { CapturingLogger, gate, listening, loggedUnavailable, nextEvent } from '../support/lock-testing.js';
import { RedisServer } from '../support/redis-server.js';

const ran: string[] = [];
/** Holds `slow` until the test opens it; `entered` opens once `slow` runs for two fields (made again, like `ran`, for each driver). */
let release = gate<void>();
let entered = gate<void>();
let running = 0;

@ObjectType()
class Reservation {
  @Field(() => Int)
  id!: number;
  @Field(() => String, { nullable: true })
  key?: string;
  @Field(() => Int, { nullable: true })
  holdCount?: number;
}

let redis: RedisServer;

@Resolver()
class OrdersResolver {
  constructor(private readonly locks: LockService) {}

  // @Locked below the GraphQL decorator, on a resolver with an @Args parameter
  @Mutation(() => Reservation)
  @Locked('order:<0>', { onContention: 'fail' })
  async reserve(@Args('id', { type: () => Int }) id: number): Promise<Reservation> {
    ran.push(`reserve:${id}`);
    return { id, key: this.locks.current()?.key, holdCount: this.locks.current()?.holdCount };
  }

  // @Locked above the GraphQL decorator, on a resolver without parameters (Nest passes it none of
  // its own, so @Locked applies its interceptor)
  @Locked('report', { onContention: 'fail' })
  @Query(() => String)
  async report(): Promise<string> {
    ran.push('report');
    return this.locks.current()?.key ?? 'no lock';
  }

  // Queries run their fields concurrently: two fields on one key contend within one request.
  @Query(() => Int, { nullable: true })
  @Locked('stock:<0>', { onContention: 'fail' })
  async slow(@Args('sku', { type: () => Int }) sku: number): Promise<number> {
    if (++running === 2) entered.open();
    await release.promise;
    return sku;
  }

  @Mutation(() => Boolean, { nullable: true })
  @Locked('job:<0>', { leaseMs: 600, watchdog: true })
  async long(@Args('id', { type: () => Int }) id: number): Promise<boolean> {
    const lock = this.locks.current()!;
    await redis.client().del(`lock:{job:${id}}`);
    await new Promise((resolve) => lock.signal.addEventListener('abort', resolve, { once: true }));
    lock.signal.throwIfAborted();
    return true;
  }
}

interface GraphQLBody {
  data: Record<string, unknown> | null;
  errors?: { message: string; path: string[]; extensions: Record<string, unknown> }[];
}

const drivers: [string, () => DynamicModule, () => FastifyAdapter | undefined][] = [
  [
    'Apollo on Express',
    () => GraphQLModule.forRoot<ApolloDriverConfig>({ driver: ApolloDriver, autoSchemaFile: true, includeStacktraceInErrorResponses: false }),
    () => undefined,
  ],
  ['Mercurius on Fastify', () => GraphQLModule.forRoot<MercuriusDriverConfig>({ driver: MercuriusDriver, autoSchemaFile: true }), () => new FastifyAdapter()],
];

describe.each(drivers)('@Locked on GraphQL resolvers (@nestjs/graphql, %s)', (_driver, graphQLModule, adapter) => {
  let app: INestApplication;
  let locks: LockService;
  let logger: CapturingLogger;
  let url: string;
  beforeAll(async () => {
    [release, entered, running] = [gate<void>(), gate<void>(), 0];
    ran.length = 0;
    redis = await RedisServer.start();
    @Module({
      imports: [LockModule.forRoot({ redis: redis.url }), graphQLModule()],
      providers: [OrdersResolver],
    })
    class AppModule {}
    logger = new CapturingLogger();
    const platform = adapter();
    app = platform ? await NestFactory.create(AppModule, platform, { logger }) : await NestFactory.create(AppModule, { logger });
    url = `${await listening(app)}/graphql`;
    locks = app.get(LockService);
  });
  afterAll(async () => {
    await app?.close();
    await redis?.stop();
  });

  async function graphql(query: string): Promise<{ status: number; body: GraphQLBody }> {
    const response = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ query }) });
    return { status: response.status, body: (await response.json()) as GraphQLBody };
  }

  /** What Nest's ExceptionsHandler logged: every error a resolver throws that is not intrinsic. */
  const unhandled = () => logger.entries.filter((e) => e.level === 'error' && e.context === 'ExceptionsHandler');

  it('locks a resolver on the key from its @Args', async () => {
    const { status, body } = await graphql('mutation { reserve(id: 4) { id key holdCount } }');
    expect(status).toBe(200);
    expect(body).toEqual({ data: { reserve: { id: 4, key: 'order:4', holdCount: 1 } } });
    expect(await locks.isLocked('order:4')).toBe(false);
  });

  it('answers contention with a GraphQL error whose extensions carry code LOCK_NOT_ACQUIRED, the key and retryAfterMs, and logs nothing', async () => {
    const holder = await locks.acquire('order:5', { leaseMs: 5_000 });
    try {
      const { status, body } = await graphql('mutation { reserve(id: 5) { id key } }');
      expect(status).toBe(200);
      expect(body.data).toBeNull();
      expect(body.errors).toHaveLength(1);
      const [error] = body.errors!;
      expect(error.path).toEqual(['reserve']);
      expect(error.message).toMatch(/^Lock "order:5" is held by another owner/);
      expect(error.extensions).toEqual({ code: 'LOCK_NOT_ACQUIRED', key: 'order:5', retryAfterMs: expect.any(Number) });
      expect(error.extensions.retryAfterMs as number).toBeGreaterThan(4_000);
      expect(ran).not.toContain('reserve:5');
      expect(unhandled()).toEqual([]);
    } finally {
      await holder.release();
    }
  });

  it('translates the same way on a resolver without parameters (through LockInterceptor)', async () => {
    expect((await graphql('{ report }')).body).toEqual({ data: { report: 'report' } });
    const holder = await locks.acquire('report', { leaseMs: 5_000 });
    try {
      const { body } = await graphql('{ report }');
      expect(body.errors?.[0].extensions).toMatchObject({ code: 'LOCK_NOT_ACQUIRED', key: 'report' });
      expect(ran.filter((r) => r === 'report')).toHaveLength(1);
      expect(unhandled()).toEqual([]);
    } finally {
      await holder.release();
    }
  });

  it('fails only the field that lost the race when two fields of one query contend for a key', async () => {
    const contended = nextEvent(locks.events$, 'contended', (e) => e.key === 'stock:1');
    const answer = graphql('{ a: slow(sku: 1) b: slow(sku: 1) c: slow(sku: 2) }');
    // One of a and b holds stock:1 and c stock:2, both still running, and the other of a and b was refused.
    await Promise.all([entered.promise, contended]);
    release.open();
    const { body } = await answer;
    const failed = body.errors ?? [];
    expect(failed).toHaveLength(1);
    expect(failed[0].extensions).toMatchObject({ code: 'LOCK_NOT_ACQUIRED', key: 'stock:1' });
    expect(['a', 'b']).toContain(failed[0].path[0]);
    const won = failed[0].path[0] === 'a' ? 'b' : 'a';
    expect(body.data).toEqual({ [won]: 1, [failed[0].path[0]]: null, c: 2 });
  });

  it('gives the LockGraphQLError the lock error as its cause, for the application\'s own filters', async () => {
    const error = new LockNotAcquiredError('order:9', 1_000, 0, 'contended');
    const translated = await translateLockError(error, { getType: () => 'graphql' } as unknown as ExecutionContext, locks);
    expect(translated).toBeInstanceOf(LockGraphQLError);
    expect((translated as LockGraphQLError).cause).toBe(error);
    expect((translated as LockGraphQLError).extensions).toEqual({ code: 'LOCK_NOT_ACQUIRED', key: 'order:9', retryAfterMs: 1_000 });
  });

  it('answers LOCK_LOST when the handler stopped because its lock was lost', async () => {
    const { body } = await graphql('mutation { long(id: 2) }');
    expect(body.errors?.[0].extensions).toMatchObject({ code: 'LOCK_LOST', key: 'job:2' });
    expect(unhandled()).toEqual([]);
  });

  it('answers LOCK_UNAVAILABLE, with the cause logged and not sent, when Redis does not answer', async () => {
    redis.pause();
    try {
      const { body } = await graphql('mutation { reserve(id: 10) { id } }');
      const error = body.errors?.[0];
      expect(error?.extensions).toEqual({ code: 'LOCK_UNAVAILABLE', key: 'order:10' });
      expect(error?.message).not.toMatch(/no answer/);
      expect(loggedUnavailable(logger, 'order:10')).toBe(true);
      expect(ran).not.toContain('reserve:10');
    } finally {
      redis.resume();
    }
  });
});
