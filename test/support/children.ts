import { fork, type ChildProcess } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { repoRoot as root } from './paths.js';

/** A message a fixture sends to the test over IPC. */
export interface FixtureMessage {
  type: string;
  [field: string]: unknown;
}

/**
 * Where an exited fixture's stderr is handed to the test environment, on the test file's global:
 * test/support/jest-environment.mjs looks in it for the warnings it fails a test on, and charges
 * them to the test during which the fixture exited (or, after the last test, to the file).
 */
const FIXTURE_STDERR = '__nestjsLockedFixtureStderr'; // jest-environment.mjs reads it by this name

/**
 * Whether process `pid` runs: it exists and is not a zombie (an orphan killed on these machines stays
 * one: their init does not reap orphans). Reads /proc (Linux), after the last ')' of its stat line:
 * the command name before it may hold spaces and parentheses. The test environment
 * (jest-environment.mjs, plain JavaScript) reads the same line for a whole process group.
 */
export function processRunning(pid: number): boolean {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
    return stat.slice(stat.lastIndexOf(')') + 2).split(' ')[0] !== 'Z';
  } catch {
    return false;
  }
}

/**
 * Where a test file's child processes (fixtures, redis-servers, sentinels, the sample's commands) are
 * registered, on its global, with what each one is: test/support/jest-environment.mjs fails the file
 * for each one still running after its last test and afterAll hooks, and kills it. A listener on
 * `process` would not do: a test file's `process` is Jest's copy of it, whose 'exit' never comes.
 */
const CHILDREN = '__nestjsLockedChildren'; // jest-environment.mjs keeps it by this name

/**
 * A registered child: what it is, and whether it leads a process group of its own (spawned with
 * `detached`), whose every member counts as it and is killed with it. jest-environment.mjs reads
 * these two fields.
 */
interface Tracked {
  what: string;
  group: boolean;
}

/**
 * Registers `child` (described as `what`) until it exits, or with `group` (a child spawned with
 * `detached`, which leads a process group) until the last process of its group exits: in a test
 * file, with the test environment; elsewhere (the benchmarks), with this process, which kills them
 * when it exits or is told to end by SIGTERM or SIGINT.
 */
export function track(child: ChildProcess, what: string, { group = false } = {}): void {
  const registry = ((globalThis as Record<string, unknown>)[CHILDREN] as Map<ChildProcess, Tracked> | undefined) ?? outsideJest();
  registry.set(child, { what, group });
  // A group outlives its leader: it stays registered, and whoever reads the registry asks whether the group has a process left.
  if (!group) child.once('exit', () => registry.delete(child));
}

let untracked: Map<ChildProcess, Tracked> | undefined;
/** The children of a process that runs outside Jest, killed with it. */
function outsideJest(): Map<ChildProcess, Tracked> {
  if (untracked) return untracked;
  const children = (untracked = new Map());
  const killAll = () => {
    for (const [child, { group }] of children) {
      try {
        if (group) process.kill(-child.pid!, 'SIGKILL');
        else child.kill('SIGKILL');
      } catch {
        // the group is gone
      }
    }
  };
  process.once('exit', killAll);
  for (const signal of ['SIGTERM', 'SIGINT'] as const) {
    process.once(signal, () => {
      killAll();
      process.kill(process.pid, signal); // the process still ends as asked
    });
  }
  return children;
}

/**
 * A child Node process running a fixture from test/fixtures (compiled by the global setup into
 * .test-build). Messages arrive over IPC; the test awaits them instead of sleeping. `exited`
 * resolves once the process has exited and its stderr is read to the end.
 */
export class Fixture {
  readonly messages: FixtureMessage[] = [];
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  private readonly waiting: { test: (m: FixtureMessage) => boolean; resolve: (m: FixtureMessage) => void }[] = [];
  private readonly child: ChildProcess;
  stderr = '';

  constructor(name: string, args: string[]) {
    this.child = fork(join(root, '.test-build', 'test', 'fixtures', `${name}.js`), args, {
      stdio: ['ignore', 'inherit', 'pipe', 'ipc'],
      execArgv: [],
    });
    track(this.child, `fixture ${name}`);
    this.child.stderr!.on('data', (chunk: Buffer) => (this.stderr += chunk.toString()));
    this.child.on('message', (m: FixtureMessage) => {
      this.messages.push(m);
      for (const w of [...this.waiting]) {
        if (w.test(m)) {
          this.waiting.splice(this.waiting.indexOf(w), 1);
          w.resolve(m);
        }
      }
    });
    this.exited = new Promise((resolve) =>
      this.child.once('close', (code, signal) => {
        if (this.stderr) {
          const exitedFixtures = ((globalThis as Record<string, unknown>)[FIXTURE_STDERR] ??= []) as { fixture: string; stderr: string }[];
          exitedFixtures.push({ fixture: `${name} (pid ${this.child.pid})`, stderr: this.stderr });
        }
        resolve({ code, signal });
      }),
    );
  }

  get pid(): number {
    return this.child.pid!;
  }

  /** The first message (already received or future) of `type` that matches `where`. */
  next(type: string, where: (m: FixtureMessage) => boolean = () => true, ms = 30_000): Promise<FixtureMessage> {
    const test = (m: FixtureMessage) => m.type === type && where(m);
    const seen = this.messages.find(test);
    if (seen) return Promise.resolve(seen);
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`fixture ${this.pid}: no "${type}" message within ${ms} ms\n${this.stderr}`)), ms);
      this.waiting.push({ test, resolve: (m) => (clearTimeout(timer), resolve(m)) });
      void this.exited.then(({ code, signal }) => {
        clearTimeout(timer);
        reject(new Error(`fixture ${this.pid} exited (${code ?? signal}) before sending "${type}"\n${this.stderr}`));
      });
    }).then((m) => m as FixtureMessage);
  }

  send(message: FixtureMessage): void {
    this.child.send(message);
  }

  kill(signal: NodeJS.Signals = 'SIGKILL'): void {
    this.child.kill(signal);
  }

  /** Kills the child if it is still running and waits for it to be gone. */
  async stop(): Promise<void> {
    if (this.child.exitCode === null && this.child.signalCode === null) this.child.kill('SIGKILL');
    await this.exited;
  }
}
