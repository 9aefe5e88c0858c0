// The suite's test environment: Node's, plus two process warnings that Node only prints, made into
// failures of the test during which they came (or of the file, when they came after its last
// test):
// - DeprecationWarning: an API that a later Node removes or changes, whether the library or a
//   dependency calls it (Node warns once per process: the first file to call it in a worker fails);
// - MaxListenersExceededWarning: listeners piling up on one emitter or AbortSignal, the sign of a
//   leak.
// The same warnings printed by a fixture process (test/support/children.ts) fail the test during
// which it exited.
// It listens on the real `process`: a test file's `process` is a copy of it (jest-util's
// createProcessObject) whose listeners never hear what the real one emits. Unhandled rejections and
// uncaught exceptions need nothing here: jest-circus fails the test they happen in
// (test/harness/jest-environment.spec.ts checks all four).
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

  async setup() {
    await super.setup();
    process.on('warning', this.onWarning);
  }

  async teardown() {
    process.off('warning', this.onWarning);
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
  }
}

/** Where test/support/children.ts hands over the stderr of each fixture process that exited. */
const FIXTURE_STDERR = '__nestjsLockedFixtureStderr';

/** A warning as a failure: its name, code and message, and where it was emitted. */
function asError(warning) {
  const error = new Error(`${warning.name}${warning.code ? ` (${warning.code})` : ''}: ${warning.message}`);
  error.stack = [error.message, ...(warning.stack ?? '').split('\n').slice(1)].join('\n');
  return error;
}
