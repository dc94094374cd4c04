-- The compose stack's PostgreSQL, on its first start (an empty volume):
-- each service's login role with its password (docker-compose.yml and
-- compose.env use them). Only the roles: what each may do is granted by the
-- migrations (migrations/*_roles.sql), which the `migrate` service applies
-- as the owner, and which create these roles, passwordless, where missing.
-- Development passwords, like the superuser's.
CREATE ROLE effectively_orders   LOGIN PASSWORD 'orders';
CREATE ROLE effectively_relay    LOGIN PASSWORD 'relay';
CREATE ROLE effectively_payments LOGIN PASSWORD 'payments';
CREATE ROLE effectively_recon    LOGIN PASSWORD 'recon';
