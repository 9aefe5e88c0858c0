// The suite's test environment: Node's, plus two process warnings that Node only prints, made into
// failures of the test during which they came (or of the file, when they came after its last
// test):
// - DeprecationWarning: an API that a later Node removes or changes, whether the library or a
//   dependency calls it (Node warns once per process: the first file to call it in a worker fails);
// - MaxListenersExceededWarning: listeners piling up on one emitter or AbortSignal, the sign of a
//   leak.
// The same warnings printed by a fixture process (test/support/children.ts) fail the test during
// which it exited. And a child process that the file started (a fixture, a redis-server), or a
// process of a group it started (the sample's commands), left running after its last test and
// afterAll hooks fails the file, and is killed.
// It listens on the real `process`: a test file's `process` is a copy of it (jest-util's
// createProcessObject) whose listeners never hear what the real one emits. Unhandled rejections and
// uncaught exceptions need nothing here: jest-circus fails the test they happen in
// (test/harness/jest-environment.spec.ts checks all four).
import { readdirSync, readFileSync } from 'node:fs';
import { TestEnvironment } from 'jest-environment-node';

const FAILING_WARNINGS = new Set(['DeprecationWarning', 'MaxListenersExceededWarning']);
/** A line that Node prints for one of them, in a fixture process's stderr. */
const FAILING_LINE = new RegExp(`^.*\\b(?:${[...FAILING_WARNINGS].join('|')})\\b.*$`, 'm');

export default class GuardedEnvironment extends TestEnvironment {
  /** Failing warnings not yet charged to a test. */
  warnings = [];
  onWarning = (warning) => {
    if (FAILING_WARNINGS.has(warning.name)) this.warnings.push(warning);
  };

  /**
   * The file's child processes still running, with what each is and whether it leads a process group
   * of its own, which stays here after its leader exits (test/support/children.ts's `track` registers them).
   */
  children = new Map();
  killChildren = () => {
    for (const [child, { group }] of this.children) kill(child, group);
  };

  async setup() {
    await super.setup();
    this.global[CHILDREN] = this.children;
    process.on('warning', this.onWarning);
    // If the worker ends before the file does, its children go with it.
    process.on('exit', this.killChildren);
  }

  async teardown() {
    process.off('warning', this.onWarning);
    process.off('exit', this.killChildren);
    this.killChildren();
    await super.teardown();
  }

  /** jest-circus calls this on every event of the run, before it reports the test's result. */
  handleTestEvent(event, state) {
    const failures = event.name === 'test_done' ? event.test.errors : event.name === 'run_finish' ? state.unhandledErrors : undefined;
    if (!failures) return;
    failures.push(...this.warnings.splice(0).map(asError));
    // Those that fixture processes printed (test/support/children.ts hands their stderr over here).
    for (const { fixture, stderr } of this.global[FIXTURE_STDERR]?.splice(0) ?? []) {
      const line = FAILING_LINE.exec(stderr);
      if (line) failures.push(new Error(`fixture ${fixture} printed: ${line[0]}`));
    }
    if (event.name !== 'run_finish') return;
    return this.checkChildren(failures);
  }

  /** Fails the file for each of its child processes, or process groups, still running, and kills them. */
  async checkChildren(failures) {
    for (const [child, { what, group }] of this.children) {
      // A group is looked at once: its number may belong to another group later.
      if (group) this.children.delete(child);
      if (group && !(await groupRunningAfter(child.pid, GROUP_EXIT_MS))) continue;
      failures.push(new Error(`${what} (${group ? 'process group' : 'pid'} ${child.pid}) was still running after the file's last test and afterAll hooks: stop it there`));
      kill(child, group);
    }
  }
}

/**
 * How long a process group may take to be gone after the file's end: a file that killed a group
 * awaits its leader only, and the group's other processes may still be exiting (a Node app killed
 * with its group frees its memory first). A process still there after that was left running.
 */
const GROUP_EXIT_MS = 2_000;

/** Whether the process group `pgid` still has a process running after up to `ms` (looked at every 20 ms). */
async function groupRunningAfter(pgid, ms) {
  const deadline = Date.now() + ms;
  while (groupRunning(pgid)) {
    if (Date.now() >= deadline) return true;
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  return false;
}

/** Where the test file's global holds its child processes (test/support/children.ts registers them). */
const CHILDREN = '__nestjsLockedChildren';

/** Where test/support/children.ts hands over the stderr of each fixture process that exited. */
const FIXTURE_STDERR = '__nestjsLockedFixtureStderr';

/** SIGKILLs `child`, or with `group` every process of the group it leads. */
function kill(child, group) {
  try {
    if (group) process.kill(-child.pid, 'SIGKILL');
    else child.kill('SIGKILL');
  } catch {
    // the group is gone
  }
}

/**
 * Whether the process group `pgid` has a process left that is not a zombie. A group's processes
 * outlive its leader as orphans, and the init of these machines does not reap orphans: a killed one
 * stays a zombie, which `kill(-pgid, 0)` still finds. Read from /proc (Linux); elsewhere, that.
 */
function groupRunning(pgid) {
  let pids;
  try {
    pids = readdirSync('/proc').filter((name) => /^\d+$/.test(name));
  } catch {
    try {
      process.kill(-pgid, 0);
      return true;
    } catch {
      return false;
    }
  }
  return pids.some((pid) => {
    try {
      // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so read after the last ')'.
      const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
      const [state, , pgrp] = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
      return Number(pgrp) === pgid && state !== 'Z';
    } catch {
      return false; // gone meanwhile
    }
  });
}

/** A warning as a failure: its name, code and message, and where it was emitted. */
function asError(warning) {
  const error = new Error(`${warning.name}${warning.code ? ` (${warning.code})` : ''}: ${warning.message}`);
  error.stack = [error.message, ...(warning.stack ?? '').split('\n').slice(1)].join('\n');
  return error;
}
