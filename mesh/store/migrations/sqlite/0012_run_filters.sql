-- curfew store, version 12: the indexes of the filtered run lists (issue 23, the web
-- console's runs page; store.RunQuery). ListRuns orders by run_id (the primary key)
-- and holds only the predicates of the filters set; each filter has an index that
-- starts with its column:
--   one tenant ........ runs_tenant_id (0001: in page order), runs_tenant_created (0006)
--   every tenant ...... the primary key (in page order), runs_created (a window)
--   a model ........... runs_model_created: the model's runs in a window (a rare model
--                       in an hour reads only those rows)
--   a status .......... runs_status_id: in page order, so a page of a common status
--                       (thousands of running runs) stops at its limit
-- A combination uses the most selective of them and filters the rest on the row.
CREATE INDEX runs_created ON runs (created_ms);
CREATE INDEX runs_model_created ON runs (model, created_ms);
CREATE INDEX runs_status_id ON runs (status, run_id);
