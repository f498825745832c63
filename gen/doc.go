// Package gen holds the Go code generated from proto/ by buf. Never edit it by hand:
// run scripts/generate.sh.
package gen
