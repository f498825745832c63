// Package catalog describes the tools a model may call: the spec the model is told (name,
// purpose, JSON Schema of the arguments) and the properties the mesh acts on (side
// effects, durability), one [Tool] each.
//
// It holds the catalogue of built-in tools ([Builtins]), which toolrunner implements. Their
// names, argument types and argument validation belong to the plan format (mesh/plan),
// because a sim plan scripts calls of them by their bare names.
package catalog
