-- The stored responses of the idempotency keys of the order ids $1 to $2:
-- per key, its order id (its reference), its status, and its Location and ETag (each NULL
-- unless the headers hold exactly one). Recon compares each key's with the
-- response orders stores for that order (pipeline::contract::
-- created_response: 201, `/orders/{order_id}`, and the ETag, a BLAKE3 hash
-- of the body that PostgreSQL cannot compute), so this statement only
-- reads and the comparison is recon's own, row by row. Orders stores its
-- headers in one layout (content-type, location, etag), read by position;
-- any other is searched by name (case-insensitive); headers that are not
-- an array hold neither.
SELECT k.order_id, k.response_code,
       CASE WHEN k.usual THEN k.headers->1->>1
            ELSE (SELECT min(e.pair->>1)
                  FROM jsonb_array_elements(CASE WHEN jsonb_typeof(k.headers) = 'array'
                                                 THEN k.headers ELSE '[]' END) AS e(pair)
                  WHERE lower(e.pair->>0) = 'location' HAVING count(*) = 1) END AS location,
       CASE WHEN k.usual THEN k.headers->2->>1
            ELSE (SELECT min(e.pair->>1)
                  FROM jsonb_array_elements(CASE WHEN jsonb_typeof(k.headers) = 'array'
                                                 THEN k.headers ELSE '[]' END) AS e(pair)
                  WHERE lower(e.pair->>0) = 'etag' HAVING count(*) = 1) END AS etag
FROM (SELECT effectively.uuid_of(reference) AS order_id, response_status::int4 AS response_code,
             response_headers AS headers,
             COALESCE(jsonb_typeof(response_headers) = 'array'
                      AND jsonb_array_length(response_headers) = 3
                      AND response_headers->0->>0 = 'content-type'
                      AND response_headers->1->>0 = 'location'
                      AND response_headers->2->>0 = 'etag', false) AS usual
      FROM fx.idempotency_keys
      WHERE reference BETWEEN $1::uuid::text AND $2::uuid::text
        AND effectively.uuid_of(reference) IS NOT NULL) AS k
