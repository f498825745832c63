-- curfew store, version 12: the indexes of the filtered run lists (issue 23, the web
-- console's runs page; store.RunQuery). ListRuns orders by run_id (the primary key)
-- and holds only the predicates of the filters set, so each filter has an index that
-- starts with its column and then ranges over the creation window:
--   one tenant ........ runs_tenant_id (0001), runs_tenant_created (0006)
--   every tenant ...... the primary key, runs_created (a window alone)
--   a model ........... runs_model_created (the rare model in an hour)
--   a status .......... runs_status_created
-- A combination uses the most selective of them and filters the rest on the row.
CREATE INDEX runs_created ON runs (created_ms);
CREATE INDEX runs_model_created ON runs (model, created_ms);
CREATE INDEX runs_status_created ON runs (status, created_ms);
