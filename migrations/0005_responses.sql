-- mlxd journal schema v5: the responses POST /v1/responses stores (store: true, the default),
-- read by GET /v1/responses/{id} and by a later request's previous_response_id, removed by
-- DELETE /v1/responses/{id} and by retention. Only adds (a table, its index, one retention
-- counter): the v1-v4 tables and rows are unchanged.
CREATE TABLE responses (
    -- resp_ followed by 32 hex digits: the id the client got
    id                   TEXT    PRIMARY KEY,
    run_id               INTEGER NOT NULL REFERENCES runs(id),
    -- when the request came (the response object's created_at, to the microsecond)
    created_at           REAL    NOT NULL,
    model                TEXT    NOT NULL,
    -- the response this one continues (NULL: none). Not a foreign key: the previous one may be
    -- deleted or pruned first, after which this one can no longer be continued (404)
    previous_response_id TEXT,
    -- completed | incomplete (max_output_tokens reached); failed responses are not stored
    status               TEXT    NOT NULL CHECK (status IN ('completed', 'incomplete')),
    -- JSON array: this request's own input items (a string input as one user message item);
    -- the items of the responses before it are in their own rows
    input                TEXT    NOT NULL,
    -- JSON object: the response as GET /v1/responses/{id} returns it (its output items included)
    response             TEXT    NOT NULL
);
CREATE INDEX responses_created_at ON responses(created_at);

-- Retention prunes responses with the events of their time: a slice that prunes the events up
-- to time T removes the responses created before T. This counts the rows pruned since the
-- file was created.
ALTER TABLE retention ADD COLUMN responses_pruned INTEGER NOT NULL DEFAULT 0;
