// `npm run test:packaging`: the packed tarball installed into fresh apps (needs the npm registry).
import base from './jest.config.mjs';

export default { ...base, testMatch: ['**/*.packaging.spec.ts'], testPathIgnorePatterns: [], testTimeout: 600_000, maxWorkers: 1 };
