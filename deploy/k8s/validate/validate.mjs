// Reads a JSON array of Kubernetes objects on stdin and validates each against the Kubernetes
// API's OpenAPI schema (the npm package kubernetes-models: types, required fields, enums,
// formats). Prints one line per object, "ok KIND NAME" or "invalid KIND NAME: errors", and exits
// 1 when any is invalid. Used by tests/python/test_deploy_manifests.py; scripts/install-deps
// installs the package (npm ci here).
import { readFileSync } from "node:fs";

const docs = JSON.parse(readFileSync(0, "utf8"));
let bad = 0;
for (const doc of docs) {
  const [group, version] = doc.apiVersion.includes("/") ? doc.apiVersion.split("/")
                                                         : [null, doc.apiVersion];
  const dir = group ? `${group}/${version}` : version;
  const name = `${doc.kind} ${doc.metadata?.name ?? "?"}`;
  let Model;
  try {
    Model = (await import(`kubernetes-models/${dir}/${doc.kind}`))[doc.kind];
  } catch (e) {
    console.log(`invalid ${name}: no such kind in the schema (${doc.apiVersion})`);
    bad++;
    continue;
  }
  try {
    new Model(doc).validate();
    console.log(`ok ${name}`);
  } catch (e) {
    console.log(`invalid ${name}: ${e.message}`);
    bad++;
  }
}
process.exit(bad ? 1 : 0);
