import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { delimiter, dirname, join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import type { INestApplication } from '@nestjs/common';
import { NestFactory } from '@nestjs/core';
import { LockService } from '../../lib/index.js';
import { CapturingLogger, listening, nextEvent } from '../support/lock-testing.js';
import { RedisServer } from '../support/redis-server.js';
import { track } from '../support/children.js';
import { repoRoot } from '../support/paths.js';

// The demo's job fires every 5 s; every second here, set before the sample is loaded.
process.env.SAMPLE_INTEREST_CRON = '* * * * * *';
const { AppModule } = await import('../../sample/app.module.js');
const { SAMPLE_REDIS } = await import('../../sample/sample.constants.js');

interface Reply {
  status: number;
  retryAfter: string | null;
  body: Record<string, unknown>;
}

describe('sample app: two instances, one Redis', () => {
  let redis: RedisServer;
  const instances: INestApplication[] = [];
  const urls: string[] = [];
  beforeAll(async () => {
    redis = await RedisServer.start();
    for (const instance of ['A', 'B']) {
      const app = await NestFactory.create(AppModule.register({ redisUrl: redis.url, instance }), { logger: new CapturingLogger() });
      instances.push(app);
      urls.push(await listening(app));
    }
  });
  afterAll(async () => {
    await Promise.all(instances.map((a) => a.close()));
    await redis?.stop();
  });

  const post = async (url: string, body?: unknown): Promise<Reply> => {
    const res = await fetch(url, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body ?? {}) });
    return { status: res.status, retryAfter: res.headers.get('retry-after'), body: (await res.json()) as Record<string, unknown> };
  };

  it('never loses a withdrawal when both instances serve them at once; the service\'s lock re-enters', async () => {
    await post(`${urls[0]}/accounts/42/deposit`, { amount: 1_000 });
    const results = await Promise.all(
      Array.from({ length: 40 }, (_, i) => post(`${urls[i % 2]}/accounts/42/withdraw`, { amount: 10 })),
    );
    expect(results.map((r) => r.status)).toEqual(results.map(() => 201));
    expect(new Set(results.map((r) => r.body.instance))).toEqual(new Set(['A', 'B']));
    expect(results.every((r) => r.body.holdCount === 2)).toBe(true);
    const balances = results.map((r) => r.body.balance as number).sort((a, b) => b - a);
    // Each withdrawal saw the previous one: balances 990, 980, ..., 600, each exactly once.
    expect(balances).toEqual(Array.from({ length: 40 }, (_, i) => 990 - 10 * i));
    const res = await fetch(`${urls[1]}/accounts/42`);
    expect(await res.json()).toEqual({ id: '42', balance: 600, instance: 'B' });
  });

  it('answers 409 with Retry-After while another instance audits the account', async () => {
    const auditing = nextEvent(instances[0]!.get(LockService).events$, 'acquired', (e) => e.key === 'account:7');
    const audit = post(`${urls[0]}/accounts/7/audit?seconds=4`);
    await auditing;
    const blocked = await post(`${urls[1]}/accounts/7/withdraw`, { amount: 5 });
    expect(blocked.status).toBe(409);
    expect(Number(blocked.retryAfter)).toBeGreaterThanOrEqual(1);
    expect(blocked.body).toMatchObject({ statusCode: 409, code: 'LOCK_NOT_ACQUIRED', key: 'account:7' });
    expect((await audit).status).toBe(201);
  });

  it('keeps business errors as they are', async () => {
    const r = await post(`${urls[0]}/accounts/8/withdraw`, { amount: 5 });
    expect(r.status).toBe(409);
    expect(r.body.message).toBe('account 8 has 0, cannot withdraw 5');
    expect(r.retryAfter).toBeNull();
  });

  it('runs the interest job on exactly one instance per tick', async () => {
    const runsOf = async () => (await (await fetch(`${urls[0]}/jobs/interest`)).json()) as { tick: number; instance: string }[];
    const raw = redis.client();
    const sub = redis.client();
    // Wait for 4 runs by watching the journal list grow (keyspace notifications), not by sleeping.
    await raw.config('SET', 'notify-keyspace-events', 'Kl');
    let pushes = 0;
    const fourRuns = new Promise<void>((resolve) => sub.on('message', () => ++pushes >= 4 && resolve()));
    await sub.subscribe('__keyspace@0__:sample:interest-runs');
    await fourRuns;
    const runs = await runsOf();
    const ticks = runs.map((r) => r.tick);
    expect(new Set(ticks).size).toBe(ticks.length);
  });
});

describe('sample app without any Redis (in-process store)', () => {
  it('serves the same API from one instance, locks in this process only', async () => {
    const app = await NestFactory.create(AppModule.register({ instance: 'solo' }), { logger: new CapturingLogger() });
    const url = await listening(app);
    try {
      const post = (path: string, amount: number) =>
        fetch(`${url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ amount }) }).then((r) => r.json());
      await post('/accounts/1/deposit', 100);
      const results = (await Promise.all(Array.from({ length: 10 }, () => post('/accounts/1/withdraw', 10)))) as { balance: number; holdCount: number }[];
      expect(results.map((r) => r.balance).sort((a, b) => a - b)).toEqual([0, 10, 20, 30, 40, 50, 60, 70, 80, 90]);
      expect(results.every((r) => r.holdCount === 2)).toBe(true);
      expect(app.get(LockService).settings.store).toBe('memory');
    } finally {
      await app.close();
    }
  });
});

describe('sample app while its Redis is down', () => {
  it('logs each connection error of its data client once, until it is connected again', async () => {
    const redis = await RedisServer.start();
    const logger = new CapturingLogger();
    const app = await NestFactory.create(AppModule.register({ redisUrl: redis.url, instance: 'A' }), { logger });
    try {
      const url = await listening(app);
      await fetch(`${url}/accounts/3`).then((r) => r.json());
      // Watched by its reconnections: a listener of the test's own on 'error' would change what
      // ioredis does without one. (Whether ioredis prints "Unhandled error event" is seen in the
      // demo's own processes below: inside Jest it never prints, as the errors of node:net are not
      // instances of the Error of Jest's context.)
      const data = app.get(SAMPLE_REDIS) as import('ioredis').Redis;
      const reconnections = async (n: number) => {
        for (let i = 0; i < n; i++) await new Promise((resolve) => data.once('reconnecting', resolve));
      };
      const refused = () => logger.entries.filter((e) => e.context === 'SampleData' && e.message.includes('ECONNREFUSED')).map((e) => [e.level, e.message]);
      const warning = ['warn', `Redis connection: connect ECONNREFUSED 127.0.0.1:${new URL(redis.url).port}`];
      await Promise.all([redis.kill(), reconnections(4)]); // the lost connection, then three refused attempts
      expect(refused()).toEqual([warning]);
      // Connected again, then down again: the same message is logged again, once.
      await Promise.all([redis.launch(), new Promise((resolve) => data.once('ready', resolve))]);
      await Promise.all([redis.kill(), reconnections(4)]);
      expect(refused()).toEqual([warning, warning]);
    } finally {
      await app.close();
      await redis.stop();
    }
  });
});

/**
 * A command of the README's, run as a user runs it: its own process group (so that the instances it
 * starts go with it), its output kept, and `line(pattern)` resolving when a line of it matches.
 */
class Command {
  private readonly child: ChildProcess;
  private output = '';
  private readonly waits: { pattern: RegExp; resolve: (match: RegExpExecArray) => void }[] = [];
  readonly exited: Promise<number | null>;

  /** `command` is this Node by default (the Node the suite runs on), or a command found on PATH. */
  constructor(args: string[], env: Record<string, string>, command = process.execPath) {
    this.child = spawn(command, args, { cwd: repoRoot, env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'], detached: true });
    track(this.child, `command ${[command === process.execPath ? 'node' : command, ...args].join(' ')}`, { group: true });
    const read = (chunk: Buffer) => {
      this.output += chunk.toString();
      for (const wait of [...this.waits]) {
        const match = wait.pattern.exec(this.output);
        if (match) (this.waits.splice(this.waits.indexOf(wait), 1), wait.resolve(match));
      }
    };
    this.child.stdout!.on('data', read);
    this.child.stderr!.on('data', read);
    this.exited = new Promise((resolve) => this.child.once('exit', (code) => resolve(code)));
  }

  /** Resolves with the match once the output matches `pattern`; fails (with the output) if the command exits first or after `seconds`. */
  line(pattern: RegExp, seconds = 60): Promise<RegExpExecArray> {
    const match = pattern.exec(this.output);
    if (match) return Promise.resolve(match);
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`no ${pattern} within ${seconds} s:\n${this.output}`)), seconds * 1_000);
      this.waits.push({ pattern, resolve: (m) => (clearTimeout(timer), resolve(m)) });
      void this.exited.then((code) => (clearTimeout(timer), reject(new Error(`exited (${code}) before ${pattern}:\n${this.output}`))));
    });
  }

  /** All it has printed so far, stdout and stderr. */
  get printed(): string {
    return this.output;
  }

  /** Sends `signal` to the whole process group. */
  signal(signal: NodeJS.Signals): void {
    try {
      process.kill(-this.child.pid!, signal);
    } catch {
      // already gone
    }
  }
}

describe('the demo as the README starts it', () => {
  let redis: RedisServer;
  beforeAll(async () => {
    redis = await RedisServer.start();
  });
  afterAll(async () => {
    await redis?.stop();
  });

  it('npm run sample: builds, starts instances A and B on one Redis, which share accounts and locks; Ctrl-C stops both', async () => {
    // Port 0: each instance takes a free port when it listens and prints it (a port probed free
    // beforehand can be taken by another process before the instance binds it).
    const demo = new Command(['scripts/sample.mjs'], { REDIS_URL: redis.url, PORT_A: '0', PORT_B: '0' });
    try {
      const listeningOn = (instance: string) =>
        demo.line(new RegExp(`\\[${instance}\\] instance ${instance} listening on http://127\\.0\\.0\\.1:(\\d+) \\(locks in ${redis.url}\\)`)).then((m) => Number(m[1]));
      const a = await listeningOn('A');
      const b = await listeningOn('B');
      expect([a, b]).not.toContain(0);
      const post = (port: number, path: string, amount: number) =>
        fetch(`http://127.0.0.1:${port}/accounts/5${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ amount }) }).then((r) => r.json());
      expect(await post(a, '/deposit', 100)).toEqual({ id: '5', balance: 100, instance: 'A' });
      expect(await post(b, '/withdraw', 30)).toEqual({ id: '5', balance: 70, instance: 'B', holdCount: 2 });
      // Redis goes away: each instance's two connections (the locks', the demo data's) say so in a
      // log line (each reconnects within 2 s), and ioredis prints no "Unhandled error event" with a
      // stack per reconnect.
      await redis.kill();
      for (const instance of ['A', 'B'])
        for (const context of ['LockService', 'SampleData']) await demo.line(new RegExp(`\\[${instance}\\][^\\n]*${context}[^\\n]*Redis connection: connect ECONNREFUSED`), 10);
      await redis.launch();
      demo.signal('SIGINT');
      expect(await demo.exited).toBe(0);
      for (const port of [a, b]) await expect(fetch(`http://127.0.0.1:${port}/accounts/5`)).rejects.toThrow();
      expect(demo.printed).not.toContain('Unhandled error event');
    } finally {
      demo.signal('SIGKILL');
    }
  });

  it('npx nest start: the root nest-cli.json builds and starts one instance, on the Node the suite runs on', async () => {
    // Literally `npx nest start`, with the suite's Node first on the PATH: npx and the CLI start
    // with `#!/usr/bin/env node`, and the CLI starts the app with `node`, so all three run on it
    // (the Nest 11 run's is 20.19.0, the engines floor; see the README).
    const path = `${dirname(process.execPath)}${delimiter}${process.env.PATH ?? ''}`;
    expect(execFileSync('node', ['-p', 'process.execPath'], { env: { ...process.env, PATH: path }, encoding: 'utf8' }).trim()).toBe(process.execPath);
    // PORT=0: it takes a free port when it listens and prints it.
    const nest = new Command(['nest', 'start'], { REDIS_URL: redis.url, PORT: '0', INSTANCE: 'N', PATH: path }, 'npx');
    try {
      const port = Number((await nest.line(new RegExp(`instance N listening on http://127\\.0\\.0\\.1:(\\d+) \\(locks in ${redis.url}\\)`)))[1]);
      expect(port).not.toBe(0);
      const post = (path: string, amount: number) =>
        fetch(`http://127.0.0.1:${port}/accounts/6${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ amount }) }).then((r) => r.json());
      expect(await post('/deposit', 40)).toEqual({ id: '6', balance: 40, instance: 'N' });
      expect(await post('/withdraw', 15)).toEqual({ id: '6', balance: 25, instance: 'N', holdCount: 2 });
    } finally {
      nest.signal('SIGKILL');
      await nest.exited;
    }
  });
});
