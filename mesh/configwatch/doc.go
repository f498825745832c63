// Package configwatch keeps one configuration file live: it reloads the file when its
// content changes and on SIGHUP, and swaps the new configuration into the running
// service only once it has been read, decoded and validated. A bad file keeps the
// running configuration; the reason is logged and counted
// (curfew_config_reload_failures_total), and the watcher's [Status] reports it until a
// good file replaces it.
//
// # Use
//
//	w, err := configwatch.New(configwatch.Config[admission.Config]{
//		Name:  "admission",
//		Path:  *admissionFile,
//		Load:  decode,                    // decode + validate, nothing else
//		Apply: controller.Update,         // the swap; an error keeps the old config too
//	}, metrics, log)
//	if err != nil {
//		return err // a bad file at start stops the service, as before
//	}
//	w.Start(ctx)
//	defer w.Close()
//
// # Why polling
//
// A Kubernetes ConfigMap volume updates a file by writing a new timestamped directory and
// swapping the ..data symlink to it: the file's path stays, its inode changes, and no
// signal arrives. Watching the file with inotify misses the swap; watching the directory
// works but needs care with the swap's several events, re-adding watches, and editors
// that write by rename. Reading the file every [DefaultInterval] and comparing a hash of
// its content catches every one of these (a rewrite in place, a rename over it, a
// symlink swap, a network filesystem) with a few lines and no dependency, for the cost
// of reading a file of a few kilobytes once a second. A change is therefore picked up
// within about one interval; SIGHUP reloads at once.
//
// # What counts as a change
//
// The content, not the modification time: touching a file reloads nothing, and a file
// whose content fails to load is reported once, not once per interval. SIGHUP reloads
// whatever the content, so an operator can retry an Apply that failed for a reason
// outside the file. A file that cannot be read (removed, unreadable) is a failed reload
// too, and the running configuration stays.
//
// # Version
//
// A configuration's version is the first 12 hex digits of the SHA-256 of the file's
// bytes: the same file has the same version on every replica, so comparing replicas'
// versions says whether they run the same configuration.
package configwatch
