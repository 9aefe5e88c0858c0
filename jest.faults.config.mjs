// `npm run test:faults`: the fault-injection suite only (see TESTING.md).
import base from './jest.config.mjs';

export default { ...base, testMatch: ['**/*.faults.spec.ts'], testPathIgnorePatterns: [], testTimeout: 120_000 };
